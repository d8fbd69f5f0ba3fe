"""`exatrain bench planner`, part 1: the cost model on this machine, calibrated and held-out shapes.

Two sets of (shape, Plan) cases, measured in ONE launch of 2 ranks (`tune.measure.measure_many`:
interleaved step by step, so the load of a shared machine hits both sets alike):

  calibrated   `tune.calibrate.CALIBRATION_SHAPES`: GPT "1m" (5×128, context 256, 8 sequences),
               a tiny GPT (3×32, context 32, 4 sequences) and MLPerf's CosmoFlow 32³ (32
               channels, no BatchNorm, 4 samples), on 1 rank and under the strategies of 2
               ranks. Their measured steps fit the machine's constants: a compute factor per
               compute kind (matmul, conv) and the seconds per call of the fixed costs (`tune.overheads.fit`:
               per operator, per collective call, per FSDP2 unit)
  held-out     shapes the fit never sees: GPTs of other widths, depths, contexts and batches
               (among them the issue's ~1M-parameter GPT, 8×96, context 128), a ViT forecaster
               (a workload absent from the calibrated set: its compute uses the matmul factor
               the GPTs fitted), and CosmoFlow with 16 channels and 8 samples; each under the
               Plans a user of 2 ranks chooses between (data=2, shard=2 with ZeRO-3, and
               tensor=2, space, or full checkpointing where they apply)

heldout_tune_*: the tuner on each held-out shape with one measurement, with and without a prior
of the calibrated shapes' residuals (transfer across shapes), on the full model's predictions and
on the roofline's.

Figures (each set): step_time_mape (calibrated: leave-one-out, each case predicted from a fit on
the others), memory_mape, top1_regret (per shape: measured step of the predicted best / measured
step of the measured best − 1; mean over shapes, and the worst), kendall_tau (rank correlation of
predicted and measured steps over the pairs of Plans of the same shape). The roofline figures
(the overhead terms off, only the compute factor fitted) say what the terms bought; per held-out
case, `fixed_by` names the term whose removal (and refit) hurts that case most.

Memory is not fitted: measured = state when a step begins + StepPeak of its forward/backward,
predicted = the cost model's total per rank.
"""

from __future__ import annotations

import dataclasses
import statistics


def _gpt(layers: int, width: int, heads: int, context: int) -> list:
    return ["run.workload=gpt", "model.preset=1m", f"model.n_layer={layers}",
            f"model.n_embd={width}", f"model.n_head={heads}", f"model.block_size={context}"]


# held out, shape name: (config overrides, batch)
HELDOUT_SHAPES = {
    "gpt-8x96-t128": (_gpt(8, 96, 4, 128), 8),       # the issue's ~1M-parameter GPT
    "gpt-2x256-t64": (_gpt(2, 256, 8, 64), 16),      # wide and shallow, short context
    "gpt-12x64-t64": (_gpt(12, 64, 4, 64), 8),       # deep and narrow
    "vit-4x96": (["run.workload=vit", "data.height=32", "data.width=64", "model.embed_dim=96",
                  "model.depth=4", "model.num_heads=4"], 8),
    "cosmoflow-16c": (["run.workload=cosmoflow", "model.size=32", "model.base_channels=16",
                       "model.batchnorm=false"], 8),
}


def heldout_cases() -> list[tuple[str, object, object]]:
    """(shape, Plan, Options) of the held-out shapes: the Plans of 2 ranks a user weighs."""
    from ..plan import Plan
    from ..tune.layout import Options

    def o(shape, **kw):
        return Options(batch=HELDOUT_SHAPES[shape][1], **kw)
    out = []
    for shape, third in (("gpt-8x96-t128", (Plan(tensor=2), {})),
                         ("gpt-2x256-t64", (Plan(tensor=2), {})),
                         ("gpt-12x64-t64", (Plan(data=2), {"checkpointing": "full"})),
                         ("vit-4x96", (Plan(data=2), {"checkpointing": "full"})),
                         ("cosmoflow-16c", (Plan(space=(2, 1, 1)), {}))):
        out += [(shape, Plan(data=2), o(shape)), (shape, Plan(shard=2), o(shape, zero_stage=3)),
                (shape, third[0], o(shape, **third[1]))]
    return out


def cases() -> list[tuple[str, str, object, object]]:
    """(set, shape, Plan, Options) of every case, calibrated first."""
    from ..tune.calibrate import calibration_cases
    return [("calibrated", *c) for c in calibration_cases()] + \
        [("heldout", *c) for c in heldout_cases()]


def _mape(pairs) -> float:
    pairs = list(pairs)
    return 100 * sum(abs(p / m - 1) for p, m in pairs) / len(pairs) if pairs else float("nan")


def kendall_tau(groups: list[list[tuple]], resolved: bool = False) -> float:
    """Kendall's τ over the pairs within each group of (predicted, measured[, noise]):
    (concordant − discordant) / pairs, a pair tied in either counting as neither. With
    `resolved`, only the pairs whose measured steps differ by more than both cases' noise (the
    relative difference of the two halves of their timed steps) are counted."""
    conc = disc = pairs = 0
    for g in groups:
        for i in range(len(g)):
            for j in range(i + 1, len(g)):
                if resolved and abs(g[i][1] / g[j][1] - 1) <= max(g[i][2], g[j][2]):
                    continue
                s = (g[i][0] - g[j][0]) * (g[i][1] - g[j][1])
                pairs += 1
                conc += s > 0
                disc += s < 0
    return (conc - disc) / pairs if pairs else float("nan")


def _halves_spread(times: list[float]) -> float:
    """|median of the first half of the timed steps / median of the second − 1|: how much the
    same case moved within the run (the load of a shared machine drifts)."""
    half = len(times) // 2
    if half < 1:
        return 0.0
    return abs(statistics.median(times[:half]) / statistics.median(times[half:]) - 1)


def top1_regrets(groups: list[list[tuple[float, float]]]) -> list[float]:
    """Per group of (predicted, measured): measured of the predicted best / measured best − 1."""
    return [min(g)[1] / min(m for _p, m in g) - 1 for g in groups if len(g) > 1]


def _figures(entries, predicted_step, predicted_memory, prefix: str) -> dict:
    groups: dict = {}
    for e, p in zip(entries, predicted_step):
        if e["world"] > 1:
            groups.setdefault(e["shape"], []).append((p, e["measured_step_s"], e["noise"]))
    regrets = top1_regrets([[g[:2] for g in group] for group in groups.values()])
    return {f"{prefix}_cases": len(entries),
            f"{prefix}_step_time_mape": _mape((p, e["measured_step_s"])
                                              for e, p in zip(entries, predicted_step)),
            f"{prefix}_memory_mape": _mape((p, e["measured_memory"])
                                           for e, p in zip(entries, predicted_memory)),
            f"{prefix}_top1_regret": statistics.mean(regrets) if regrets else float("nan"),
            f"{prefix}_top1_regret_worst": max(regrets) if regrets else float("nan"),
            f"{prefix}_kendall_tau": kendall_tau(list(groups.values())),
            f"{prefix}_kendall_tau_resolved": kendall_tau(list(groups.values()), resolved=True),
            f"{prefix}_pairs_unresolved": sum(
                abs(g[i][1] / g[j][1] - 1) <= max(g[i][2], g[j][2])
                for g in groups.values() for i in range(len(g)) for j in range(i + 1, len(g))),
            f"{prefix}_shapes": len(groups)}


def ties(entries, predicted, error: float) -> dict:
    """`exatrain plan`'s honesty on the held-out shapes: a shape whose two fastest predicted Plans
    are within the model's error (the calibrated leave-one-out MAPE) is flagged a tie, not
    ranked; the regret over the shapes it did rank, and the measured gap of the flagged ones."""
    shapes: dict = {}
    for e, p in zip(entries, predicted):
        if e["world"] > 1:
            shapes.setdefault(e["shape"], []).append((p, e["measured_step_s"]))
    flagged, ranked = [], []
    for g in shapes.values():
        g = sorted(g)
        (ranked if len(g) < 2 or g[1][0] > g[0][0] * (1 + error) else flagged).append(g)
    return {"heldout_tie_error": error, "heldout_shapes_flagged_tie": len(flagged),
            "heldout_top1_regret_ranked": statistics.mean(top1_regrets(ranked))
            if ranked else float("nan"),
            "heldout_flagged_measured_gap": [g[1][1] / g[0][1] - 1 for g in flagged]}


def transfer(entries, preds, cal, held, budget: int = 1) -> dict:
    """The tuner on each held-out shape with `budget` measurements, answered from this launch's
    measurements, with and without a prior of the calibrated shapes' residuals (transfer across
    shapes through the shape features of `tuner.features`): the regret of its best."""
    import math

    from ..tune.tuner import features, search
    prior = [(features(preds[i], entries[i]["params"]),
              math.log(entries[i]["measured_step_s"] / preds[i].step_s)) for i in cal]
    shapes: dict = {}
    for i in held:
        shapes.setdefault(entries[i]["shape"], []).append(i)
    out = {"with": [], "without": []}
    for idx in shapes.values():
        cands = [preds[i] for i in idx]
        table = {id(preds[i]): entries[i]["measured_step_s"] for i in idx}
        best = min(table.values())
        params = entries[idx[0]]["params"]
        for key, points in (("without", ()), ("with", prior)):
            found = search(cands, lambda p: table[id(p)], budget, params, points, min_gain=None)
            out[key].append(found.best.measured_s / best - 1)
    return {"heldout_tune_budget": budget,
            "heldout_tune_regret_without_prior": statistics.mean(out["without"]),
            "heldout_tune_regret_with_prior": statistics.mean(out["with"])}


def local_part(steps: int, warmup: int = 3) -> tuple[dict, list]:
    from ..train.config import load_config
    from ..tune.calibrate import CALIBRATION_SHAPES
    from ..tune.measure import measure_many
    from ..tune.spec import spec_from_config
    from ..tune.systems import load_system

    shipped = load_system("cpu-local")
    plan_cases = cases()
    configs = {s: load_config(None, [*ov, f"train.batch_size={b}"])
               for s, (ov, b) in {**CALIBRATION_SHAPES, **HELDOUT_SHAPES}.items()}
    specs = {s: spec_from_config(c) for s, c in configs.items()}
    probe: dict = {}
    measured = measure_many([(configs[s], p, o) for _set, s, p, o in plan_cases], 2, steps,
                            warmup, serial_threads=1, probe=probe)
    cores = probe["cores_available"]
    # the system as `exatrain plan --calibrate` measured it, its fit undone: the compute
    # factors and fixed costs are fitted again here, in this launch, on the calibrated shapes
    bare = dataclasses.replace(shipped, overheads={},
                               measured={**shipped.measured, "cores": cores})

    entries = []
    for (which, shape, plan, options), got in zip(plan_cases, measured):
        ledger = {a: b for a, b in got["ledger_bytes"].items() if b}
        entries.append({"set": which, "shape": shape, "model": specs[shape].name,
                        "params": specs[shape].params, "plan": str(plan),
                        "options": options.label(), "world": plan.world_size,
                        "kind": specs[shape].compute_kind,
                        "measured_step_s": got["step_s"], "measured_step_s_min": got["step_s_min"],
                        "noise": _halves_spread(got["step_times"]),
                        "measured_memory": got["step_peak_bytes"], "ledger_bytes": ledger})
    result = {"cores_available": cores, "timed_steps": steps, "warmup_steps": max(2, warmup)}
    result.update(analyse(entries, plan_cases, specs, bare))
    return result, entries


def analyse(entries: list, plan_cases: list, specs: dict, bare) -> dict:
    """The fits and figures of measured `entries` (one per case of `plan_cases`, see
    `local_part`), `bare` the system without fixed costs; fills the entries' predictions."""
    from ..tune.calibrate import fit_cases, fitted_system, rank_system
    from ..tune.cost import predict
    from ..tune.overheads import TERMS
    cal = [i for i, e in enumerate(entries) if e["set"] == "calibrated"]
    held = [i for i, e in enumerate(entries) if e["set"] == "heldout"]
    measured_s = [e["measured_step_s"] for e in entries]
    kinds = [e["kind"] for e in entries]

    def predict_all(idx):
        def run(system):
            return [predict(specs[plan_cases[i][1]], plan_cases[i][2],
                            rank_system(system, plan_cases[i][2].world_size), plan_cases[i][3])
                    for i in idx]
        return run

    def fit_on(idx, drop=()):
        return fit_cases(predict_all(idx), [measured_s[i] for i in idx],
                         [kinds[i] for i in idx], bare, drop)

    def predict_with(fit, idx) -> list[float]:
        return [p.step_s for p in predict_all(idx)(fitted_system(bare, fit))]

    full = fit_on(cal)
    roofline = fit_on(cal, drop=TERMS)
    held_pred = predict_with(full, held)
    held_roof = predict_with(roofline, held)
    # calibrated, leave-one-out: each case from a fit on the other calibrated cases
    cal_pred = [predict_with(fit_on([j for j in cal if j != i]), [i])[0] for i in cal]
    cal_roof = [predict_with(fit_on([j for j in cal if j != i], drop=TERMS), [i])[0]
                for i in cal]
    # which term fixed which case: refit without each term, the held-out errors that grow most
    without = {t: predict_with(fit_on(cal, drop=(t,)), held) for t in TERMS}
    fitted = predict_all(range(len(entries)))(fitted_system(bare, full))
    for k, i in enumerate(held):
        e = entries[i]
        e["predicted_step_s"] = held_pred[k]
        e["roofline_step_s"] = held_roof[k]
        err = abs(held_pred[k] / e["measured_step_s"] - 1)
        worse = {t: abs(without[t][k] / e["measured_step_s"] - 1) - err for t in TERMS}
        best = max(worse, key=worse.get)
        # only where the terms helped: the roofline's error above the full model's
        helped = abs(held_roof[k] / e["measured_step_s"] - 1) > err
        e["fixed_by"] = best if helped and worse[best] > 0.02 else ""
        e["error_without_term"] = {t: worse[t] + err for t in TERMS}
    for k, i in enumerate(cal):
        entries[i]["predicted_step_s"] = cal_pred[k]
        entries[i]["roofline_step_s"] = cal_roof[k]
    for e, p in zip(entries, fitted):
        e["predicted_memory"] = p.memory["total"]
        e["predicted_parts_s"] = p.parts_s
        e["predicted_bytes"] = p.bytes_by_axis
        e["bytes_exact"] = e["world"] == 1 or e["ledger_bytes"] == p.bytes_by_axis
    c_entries, h_entries = [entries[i] for i in cal], [entries[i] for i in held]
    result: dict = {}
    result.update(_figures(c_entries, cal_pred, [e["predicted_memory"] for e in c_entries],
                           "calibrated"))
    result.update(_figures(h_entries, held_pred, [e["predicted_memory"] for e in h_entries],
                           "heldout"))
    roof_h = _figures(h_entries, held_roof, [e["predicted_memory"] for e in h_entries], "r")
    result.update({"heldout_roofline_step_time_mape": roof_h["r_step_time_mape"],
                   "heldout_roofline_top1_regret": roof_h["r_top1_regret"],
                   "heldout_roofline_kendall_tau": roof_h["r_kendall_tau"],
                   "calibrated_roofline_step_time_mape": _mape(
                       (p, e["measured_step_s"]) for e, p in zip(c_entries, cal_roof))})
    result.update({f"heldout_step_time_mape_without_{t}": _mape(
        (p, e["measured_step_s"]) for e, p in zip(h_entries, without[t])) for t in TERMS})
    result.update(ties(h_entries, held_pred, result["calibrated_step_time_mape"] / 100))
    result.update(transfer(entries, fitted, cal, held))
    # the same on the roofline's predictions: can the prior learnt on the calibrated shapes
    # ("ZeRO-3 is slower than predicted") correct its inverted ranking of shapes it never saw?
    roof_preds = predict_all(range(len(entries)))(fitted_system(bare, roofline))
    result.update({k.replace("heldout_tune_", "heldout_tune_roofline_"): v for k, v in
                   transfer(entries, roof_preds, cal, held).items() if "regret" in k})
    result["step_time_mape"] = result["calibrated_step_time_mape"]
    result["memory_mape"] = result["calibrated_memory_mape"]
    result["cases"] = len(entries)
    result["bytes_exact_cases"] = sum(e["bytes_exact"] for e in entries)
    result["fitted_overheads"] = full["overheads"]
    result["fitted_compute_factor"] = full["compute_factor"]
    result["local_cases"] = entries
    return result
