"""The tuner: measure few Plans, learn where the cost model is wrong, return the best measured.

Surrogate: a small Gaussian process in numpy on the cost model's residual
r = log(measured step time) − log(predicted step time), over features of a (Plan, options):
log2 of each degree (pipe, data, shard, space, tensor), 3D tensor, ZeRO stage, checkpointing,
log2 of the world size and log10 of the parameter count. Why a GP rather than optuna's TPE: the
budget is a handful of measurements, the cost model already orders the candidates (the GP only
corrects it, starting from "no correction"), and a GP's posterior variance gives expected
improvement in closed form from three points; TPE needs tens of trials before its density
models mean anything and cannot start from a prediction. numpy only, deterministic.

Search: the first trial is the cost model's best; each next one maximises expected improvement
of the corrected prediction over the best measured time; it stops at the budget or when no
candidate is expected to improve by more than `min_gain` (1%).

Transfer: measurements of the same family at another world size or model size (a `--record`
file of an earlier run) enter the GP as extra points with more noise (`prior_noise`): their
residual pattern (e.g. "ZeRO-3 is slower than predicted here") carries over through the shared
features. The report's `prior_saved` estimates how many measurements that saved: the search is
replayed without the prior, its unmeasured answers taken from the final surrogate, and the trials
it needs to reach the same best are compared with the trials this run needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cost import Prediction
from .layout import options_from_config
from ..errors import ArgumentError
from ..plan import PlanError


def features(pred: Prediction, params: int) -> list[float]:
    """The Plan's degrees and options, the world and model size, and what describes the shape
    across models (transfer): the share of the predicted step that is compute and the share
    that is fixed costs per call (`overheads`): a residual learnt on one shape carries to
    another whose step is made of the same parts."""
    from .overheads import TERMS
    p, o = pred.plan, pred.options
    step = max(pred.step_s, 1e-30)
    return [math.log2(p.pipe), math.log2(p.data), math.log2(p.shard),
            math.log2(p.space_degree), math.log2(p.tensor_degree), float(p.tensor_3d),
            (o.zero_stage / 3.0) if p.shard > 1 else 0.0,
            1.0 if o.checkpointing != "none" else 0.0,
            0.5 * math.log2(max(p.world_size, 1)), 0.5 * math.log10(max(params, 1)),
            pred.parts_s.get("compute", 0.0) / step,
            sum(pred.parts_s.get(t, 0.0) for t in TERMS) / step]


FEATURES = 12   # len(features(...)): a prior recorded with another count is refused


class GaussianProcess:
    """Zero-mean GP with a squared-exponential kernel, fixed hyperparameters, per-point noise."""

    def __init__(self, length_scale: float = 1.0, signal: float = 0.25):
        self.length_scale, self.signal = length_scale, signal
        self.x = np.zeros((0, 0))

    def _k(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return self.signal * np.exp(-0.5 * d2 / self.length_scale ** 2)

    def fit(self, x, y, noise) -> "GaussianProcess":
        self.x = np.asarray(x, dtype=float)
        y = np.asarray(y, dtype=float)
        k = self._k(self.x, self.x) + np.diag(np.asarray(noise, dtype=float))
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, y))
        return self

    def predict(self, xs) -> tuple[np.ndarray, np.ndarray]:
        xs = np.asarray(xs, dtype=float)
        if len(self.x) == 0:
            return np.zeros(len(xs)), np.full(len(xs), math.sqrt(self.signal))
        ks = self._k(xs, self.x)
        mean = ks @ self.alpha
        v = np.linalg.solve(self.chol, ks.T)
        var = np.maximum(self.signal - (v ** 2).sum(0), 1e-12)
        return mean, np.sqrt(var)


def _expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """EI of a log-time below `best` (minimisation), closed form."""
    from math import erf, exp, pi, sqrt
    z = (best - mu) / sd
    cdf = np.array([0.5 * (1 + erf(v / sqrt(2))) for v in z])
    pdf = np.array([exp(-0.5 * v * v) / sqrt(2 * pi) for v in z])
    return (best - mu) * cdf + sd * pdf


@dataclass
class Trial:
    index: int          # candidate index
    plan: str
    options: str
    predicted_s: float
    measured_s: float


@dataclass
class TuneResult:
    trials: list
    best: Trial
    trials_to_best: int
    prior_points: int = 0
    prior_saved: int | None = None
    surrogate: str = "gaussian process (numpy), RBF kernel on log-degree features"


def search(candidates: list[Prediction], measure, budget: int, params: int,
           prior: list[tuple[list[float], float]] = (), noise: float = 1e-3,
           prior_noise: float = 0.02, min_gain: float | None = 0.01) -> TuneResult:
    """Measure at most `budget` of `candidates` (see the module doc); `measure(pred) -> seconds`.
    `min_gain=None` never stops before the budget."""
    if not candidates:
        raise PlanError("no candidate Plans to tune: every Plan was refused (see exatrain plan)")
    feats = np.array([features(c, params) for c in candidates])
    logp = np.log([c.step_s for c in candidates])
    px = [f for f, _ in prior]
    py = [r for _, r in prior]
    trials: list[Trial] = []
    done: set[int] = set()
    gp = GaussianProcess()
    for _ in range(min(budget, len(candidates))):
        x = px + [feats[t.index].tolist() for t in trials]
        y = py + [math.log(t.measured_s) - logp[t.index] for t in trials]
        noises = [prior_noise] * len(px) + [noise] * len(trials)
        if x:
            gp.fit(x, y, noises)
        mu, sd = gp.predict(feats)
        corrected = logp + mu
        if not trials:
            pick = int(np.argmin(corrected))
        else:
            best = min(math.log(t.measured_s) for t in trials)
            ei = _expected_improvement(corrected, sd, best)
            ei[list(done)] = -1.0
            pick = int(np.argmax(ei))
            if min_gain is not None and ei[pick] < math.log1p(min_gain) * 0.1:
                break
        seconds = float(measure(candidates[pick]))
        c = candidates[pick]
        trials.append(Trial(pick, str(c.plan), c.options.label(), c.step_s, seconds))
        done.add(pick)
    best = min(trials, key=lambda t: t.measured_s)
    to_best = trials.index(best) + 1
    return TuneResult(trials, best, to_best, prior_points=len(prior))


def estimate_prior_saving(candidates, result: TuneResult, params: int, budget: int,
                          prior) -> int:
    """Trials a prior-free search would need to reach `result.best`, minus those this one needed.

    The replay measures nothing: measured candidates answer with their measurement, the others
    with the final surrogate's corrected prediction (fitted to the prior and every measurement)."""
    feats = np.array([features(c, params) for c in candidates])
    logp = np.log([c.step_s for c in candidates])
    x = [f for f, _ in prior] + [feats[t.index].tolist() for t in result.trials]
    y = [r for _, r in prior] + [math.log(t.measured_s) - logp[t.index] for t in result.trials]
    gp = GaussianProcess().fit(x, y, [0.02] * len(prior) + [1e-3] * len(result.trials))
    mu, _ = gp.predict(feats)
    known = {t.index: t.measured_s for t in result.trials}

    def oracle(pred):
        i = candidates.index(pred)
        return known.get(i, math.exp(logp[i] + mu[i]))

    replay = search(candidates, oracle, max(budget, len(candidates)), params)
    target = result.best.measured_s * (1 + 1e-9)
    needed = next((k + 1 for k, t in enumerate(replay.trials) if t.measured_s <= target),
                  len(replay.trials))
    return max(0, needed - result.trials_to_best)


def load_prior(paths) -> list[tuple[list[float], float]]:
    """(features, residual) points from `--record` files of earlier tune runs."""
    points = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        bad = [len(p["features"]) for p in data["points"] if len(p["features"]) != FEATURES]
        if bad:
            raise ArgumentError(f"--prior {path}: its points have {bad[0]} features, this tuner "
                                f"uses {FEATURES} (recorded by an older exatrain); record it again "
                                "with `exatrain tune --record`")
        points += [(p["features"], p["residual"]) for p in data["points"]]
    return points


def tune_config(config, world: int, budget: int, system: str = "cpu-local", steps: int = 3,
                prior_paths=(), record: str = "") -> dict:
    """`exatrain tune`: rank the Plans, measure at most `budget` on spawned ranks, report."""
    from .measure import measure
    from .search import rank_plans
    from .spec import spec_from_config
    from .systems import load_system

    spec = spec_from_config(config)
    ranking = rank_plans(spec, world, load_system(system), options_from_config(config))
    candidates = ranking.ranked
    prior = load_prior(prior_paths)

    def measure_one(pred):
        return measure(config, pred.plan, pred.options, steps)["step_s"]

    result = search(candidates, measure_one, budget, spec.params, prior)
    saved = estimate_prior_saving(candidates, result, spec.params, budget, prior) if prior else 0
    points = [{"features": features(candidates[t.index], spec.params),
               "residual": math.log(t.measured_s / t.predicted_s)} for t in result.trials]
    if record:
        Path(record).parent.mkdir(parents=True, exist_ok=True)
        Path(record).write_text(json.dumps({"model": spec.name, "world": world,
                                            "points": points}, indent=1))
    return {"model": spec.name, "world": world, "candidates": len(candidates),
            "budget": budget, "tune_trials": len(result.trials),
            "best_plan": result.best.plan, "best_options": result.best.options,
            "best_measured_step_s": result.best.measured_s,
            "best_predicted_step_s": result.best.predicted_s,
            "trials_to_best": result.trials_to_best, "prior_points": len(prior),
            "prior_saved_measurements": saved, "surrogate": result.surrogate,
            "trials": [t.__dict__ for t in result.trials]}
