"""`exatrain bench planner`: the cost model's predictions against measurements and published runs.

Three parts, one launch:

1. This machine, calibrated and held-out shapes (`bench.planner_local`): the cost model's
   constants are fitted on the calibrated shapes' measured steps and predict shapes the fit never
   saw (other GPT widths, depths, contexts and batches, a ViT, CosmoFlow of another width), all
   measured in one launch. Figures: calibrated_* and heldout_* step_time_mape, memory_mape,
   top1_regret, kendall_tau; the roofline's (fixed costs off) beside them; step_time_mape and
   memory_mape are the calibrated ones. `--parts local,published` runs in a few minutes.

2. Published: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
   Models", arXiv 2205.05198, Table 5), GPT 22B/175B/530B/1T trained with Megatron on A100s of
   Selene: tensor 8, pipe 1/8/35/64, batch 4/64/280/512, micro-batch 4/1/1/1, sequence 2048, vocab
   51200, fp16, iteration times 1.42/18.13/49.05/94.42 s with full recomputation and
   1.10/13.75/37.83/71.49 s with sequence parallelism + selective recomputation (the times are
   also those Calculon, SC'23, validates against). Predicted with system a100-selene.
   published_step_time_mape uses a100-selene's matmul efficiency as shipped, which was fitted to
   these 8 runs (so it is in-sample); published_step_time_mape_loo fits it on 7 and predicts the
   8th, for each. The paper gives no per-GPU memory figures as numbers (only formulas and bar
   charts), so published_memory_mape is null: there is nothing measured to compare against.

3. Tuner: all candidate (Plan, options) of the GPT at 2 ranks are measured, interleaved in one
   launch (the exhaustive search; medians of the timed steps), then the tuner runs with budget =
   a third of them, answered from those measurements (a replay: both searches see the same
   noisy numbers). With a prior from a sibling GPT (width 192, every candidate measured) the
   tuner runs again. The replays are repeated on each block's table (tune_gap_blocks), and
   tune_table_block_spread (median over candidates of max/min − 1 of its block medians) says
   how much a candidate's time moves between repeats, against tune_table_range (slowest/fastest
   − 1) between candidates. tune_gap_held_out: both searches choose on two blocks and their
   choices are timed on the third (each block held out once), so the exhaustive best is not
   simply the luckiest of the noisy numbers.
   tune_prior_saved_trials: the searches replayed without budget (every answer is in the table),
   how many more trials the prior-free one needs to come within 5% of the exhaustive best
   (trials_to_5pct_without_prior − trials_to_5pct_with_prior); tune_prior_saved_estimate is what
   `exatrain tune` itself would report (tuner.estimate_prior_saving, no exhaustive table).
   Figures: tune_trials, tune_best_step_s, exhaustive_best_step_s, tune_gap (best/exhaustive − 1),
   tune_gap_blocks, tune_candidates, tune_prior_trials, tune_prior_gap, tune_prior_saved_trials.
"""

from __future__ import annotations

import math

PUBLISHED = {   # name: (hidden, heads, layers, tensor, pipe, batch, micro, full_s, seqsel_s)
    "22B": (6144, 64, 48, 8, 1, 4, 4, 1.42, 1.10),
    "175B": (12288, 96, 96, 8, 8, 64, 1, 18.13, 13.75),
    "530B": (20480, 128, 105, 8, 35, 280, 1, 49.05, 37.83),
    "1T": (25600, 160, 128, 8, 64, 512, 1, 94.42, 71.49),
}
# Memory per GPU (GiB) of the same four Megatron runs, Korthikanti et al. 2022 (arXiv 2205.05198)
# Figure 1: parameters + optimizer state, and activations, without recomputation or sequence
# parallelism ("none") and with sequence parallelism + selective recomputation ("seqsel"). The
# paper draws them as bars; these are the values Calculon (SC'23) validates its memory model
# against (calculon-ai/calculon, calculon/llm/validation.py, `seqsel_fig1`). The runs are those
# of Table 5 (tensor 8, pipe 1/8/35/64, the micro-batches of PUBLISHED); activations are the
# first pipeline stage's, which keeps the most micro-batches.
PUBLISHED_MEMORY_GIB = {   # name: {mode: (params + optimizer, activations)}
    "22B": {"none": (45.5625, 59.25), "seqsel": (45.5625, 9.5625)},
    "175B": {"none": (45.5625, 66.84375), "seqsel": (45.5625, 12.3515625)},
    "530B": {"none": (31.640625, 114.0234375), "seqsel": (31.640625, 23.076171875)},
    "1T": {"none": (32.958984375, 131.25), "seqsel": (32.958984375, 26.5625)},
}


def add_arguments(parser) -> None:
    parser.add_argument("--parts", default="local,published,tuner",
                        help="which parts to run, comma-separated")


def _megatron_options(batch: int, micro: int, pipe: int, mode: str):
    """Options of a Megatron run of Korthikanti et al. 2022: fp16, its micro-batches, and where
    it differs from exatrain's layers: vocabulary-parallel embedding, attention that keeps
    softmax and dropout (which selective recomputation recomputes), fp32 gradient buffers.
    These describe the published runs; none is fitted to their figures."""
    from ..tune.layout import Options
    return Options(batch=batch, precision="fp16", zero_stage=1,
                   checkpointing={"seqsel": "selective"}.get(mode, mode),
                   sequence_parallel=mode == "seqsel", attention="materialised",
                   vocab_parallel=True, fp32_grads=True,
                   microbatches=batch // micro if pipe > 1 else 0)


def published_cases(system=None) -> list[dict]:
    """Predicted against published iteration times and memory (part 2 of the module doc)."""
    from ..models.gpt import GPTConfig
    from ..plan import Plan
    from ..tune.cost import predict
    from ..tune.spec import gpt_spec
    from ..tune.systems import load_system

    system = system or load_system("a100-selene")
    out = []
    for name, (h, a, layers, t, p, batch, micro, full_s, sel_s) in PUBLISHED.items():
        cfg = GPTConfig(vocab_size=51200, block_size=2048, n_layer=layers, n_head=a, n_embd=h)
        spec = gpt_spec(cfg, name)
        for mode, ref in (("full", full_s), ("seqsel", sel_s), ("none", None)):
            pred = predict(spec, Plan(pipe=p, tensor=t), system,
                           _megatron_options(batch, micro, p, mode))
            first = pred.memory_by_stage[0]
            case = {"model": name, "mode": mode, "published_s": ref,
                    "predicted_s": pred.step_s, "compute_s": pred.parts_s["compute"],
                    "memory_per_rank": pred.memory["total"],
                    "predicted_state_gib": first["state"] / 2 ** 30,
                    "predicted_activations_gib": first["activations"] / 2 ** 30}
            if mode in PUBLISHED_MEMORY_GIB[name]:
                state, acts = PUBLISHED_MEMORY_GIB[name][mode]
                case.update(published_state_gib=state, published_activations_gib=acts)
            out.append(case)
    return out


def published_figures(cases: list[dict]) -> dict:
    """The published MAPEs: step time (Table 5, 8 runs) and memory (Figure 1, 8 runs: params +
    optimizer + activations of the first stage's GPU, and each part on its own)."""
    timed = [c for c in cases if c["published_s"] is not None]
    mem = [c for c in cases if "published_state_gib" in c]
    return {
        "published_step_time_mape": _mape((c["predicted_s"], c["published_s"]) for c in timed),
        "published_step_time_mape_loo": published_loo(timed),
        "published_memory_mape": _mape(
            (c["predicted_state_gib"] + c["predicted_activations_gib"],
             c["published_state_gib"] + c["published_activations_gib"]) for c in mem),
        "published_memory_state_mape": _mape((c["predicted_state_gib"],
                                              c["published_state_gib"]) for c in mem),
        "published_memory_activations_mape": _mape((c["predicted_activations_gib"],
                                                    c["published_activations_gib"])
                                                   for c in mem),
        "published_memory_cases": len(mem)}


def _mape(pairs) -> float:
    pairs = list(pairs)
    return 100 * sum(abs(p / m - 1) for p, m in pairs) / len(pairs) if pairs else float("nan")


def published_loo(cases: list[dict]) -> float:
    """MAPE when each case's compute efficiency is fitted on the others (median ratio)."""
    import statistics
    errs = []
    for i, c in enumerate(cases):
        others = [o for j, o in enumerate(cases) if j != i]
        # compute scales with 1/efficiency; fit the factor that makes the others right on median
        factor = statistics.median((o["published_s"] - (o["predicted_s"] - o["compute_s"]))
                                   / o["compute_s"] for o in others)
        pred = c["predicted_s"] - c["compute_s"] + c["compute_s"] * factor
        errs.append(abs(pred / c["published_s"] - 1))
    return 100 * sum(errs) / len(errs)


BLOCKS = 3   # the timed steps are cut into this many consecutive blocks, each a repeat


def _blocks(times: list, n: int = BLOCKS) -> list[list]:
    """`times` cut into `n` consecutive blocks (the last ones one longer when it does not
    divide): each block is one repeat of the interleaved measurement."""
    k, r = divmod(len(times), n)
    out, at = [], 0
    for b in range(n):
        size = k + (1 if b >= n - r else 0)
        out.append(times[at:at + size])
        at += size
    return [b for b in out if b]


def tuner_part(steps: int, warmup: int = 2) -> dict:
    import statistics

    from ..train.config import load_config
    from ..tune.layout import Options
    from ..tune.measure import measure_many
    from ..tune.search import rank_plans
    from ..tune.spec import spec_from_config
    from ..tune.systems import load_system
    from ..tune.tuner import estimate_prior_saving, features, search

    def measured_candidates(overrides):
        config = load_config(None, overrides)
        spec = spec_from_config(config)
        ranking = rank_plans(spec, 2, load_system("cpu-local"), Options(batch=8))
        got = measure_many([(config, p.plan, p.options) for p in ranking.ranked], 2, steps,
                           warmup)
        return spec, ranking.ranked, [g["step_times"] for g in got]

    spec, cands, times = measured_candidates(["run.workload=gpt", "model.preset=1m",
                                              "train.batch_size=8"])
    sib_spec, sib_cands, sib_times = measured_candidates(
        ["run.workload=gpt", "model.preset=1m", "model.n_embd=192", "model.n_head=6",
         "train.batch_size=8"])
    budget = max(1, len(cands) // 3)

    def replay(table: dict, sib_table: dict) -> dict:
        """The tuner and the exhaustive search on one table of measured step times."""
        def oracle(pred):
            return table[cands.index(pred)]

        plain = search(cands, oracle, budget, spec.params)
        prior = [(features(p, sib_spec.params), math.log(sib_table[i] / p.step_s))
                 for i, p in enumerate(sib_cands)]
        primed = search(cands, oracle, budget, spec.params, prior)
        exhaustive = min(table.values())

        def trials_to_within_5pct(points) -> int:
            """Replayed without a budget or early stop: every candidate is in the table."""
            full = search(cands, oracle, len(cands), spec.params, points, min_gain=None)
            return next(k + 1 for k, t in enumerate(full.trials)
                        if t.measured_s <= 1.05 * exhaustive)

        best = min(table, key=table.get)
        return {"plain": plain, "primed": primed, "prior": prior, "exhaustive": exhaustive,
                "best": best, "gap": plain.best.measured_s / exhaustive - 1,
                "prior_gap": primed.best.measured_s / exhaustive - 1,
                "to5": trials_to_within_5pct([]), "to5_prior": trials_to_within_5pct(prior)}

    def table_of(per_case, pick=None):
        return {i: statistics.median(t if pick is None else _blocks(t)[pick])
                for i, t in enumerate(per_case)}

    main = replay(table_of(times), table_of(sib_times))
    n_blocks = len(_blocks(times[0]))
    blocks = [replay(table_of(times, b), table_of(sib_times, b)) for b in range(n_blocks)]

    def pooled(per_case, skip):
        return {i: statistics.median(x for b, part in enumerate(_blocks(t)) if b != skip
                                     for x in part) for i, t in enumerate(per_case)}

    # held out: both searches choose on two blocks, their choices are timed on the third, so
    # the exhaustive best is not the luckiest of 14 noisy numbers (the winner's curse)
    held_out = []
    for h in range(n_blocks):
        chosen = replay(pooled(times, h), pooled(sib_times, h))
        timed = table_of(times, h)
        held_out.append(timed[chosen["plain"].best.index] / timed[chosen["best"]] - 1)
    plain, primed = main["plain"], main["primed"]
    table = table_of(times)
    # how far apart the candidates are against how much one candidate's time moves between
    # blocks: when the noise is as large as the differences, the measured best is partly luck
    block_spread = statistics.median(
        max(ts) / min(ts) - 1 for ts in ([statistics.median(b) for b in _blocks(t)]
                                         for t in times))
    return {"tune_candidates": len(cands), "tune_budget": budget,
            "tune_trials": len(plain.trials), "tune_best_step_s": plain.best.measured_s,
            "tune_best_plan": f"{plain.best.plan} {plain.best.options}".strip(),
            "exhaustive_best_step_s": main["exhaustive"],
            "exhaustive_best_plan": f"{cands[main['best']].plan} "
                                    f"{cands[main['best']].options.label()}".strip(),
            "tune_gap": main["gap"],
            "tune_gap_blocks": [b["gap"] for b in blocks],
            "tune_gap_spread": [min(b["gap"] for b in blocks), max(b["gap"] for b in blocks)],
            "tune_gap_held_out": held_out,
            "tune_gap_held_out_median": statistics.median(held_out),
            "tune_table_block_spread": block_spread,
            "tune_table_range": max(table.values()) / min(table.values()) - 1,
            "tune_prior_trials": len(primed.trials),
            "tune_prior_best_step_s": primed.best.measured_s,
            "tune_prior_gap": main["prior_gap"],
            "trials_to_5pct_without_prior": main["to5"],
            "trials_to_5pct_with_prior": main["to5_prior"],
            "tune_prior_saved_trials": main["to5"] - main["to5_prior"],
            "tune_prior_saved_trials_blocks": [b["to5"] - b["to5_prior"] for b in blocks],
            "tune_prior_saved_estimate": estimate_prior_saving(cands, primed, spec.params,
                                                               budget, main["prior"]),
            "measured_table": {f"{p.plan} {p.options.label()}".strip(): table[i]
                               for i, p in enumerate(cands)}}


def run(args) -> dict:
    parts = {p.strip() for p in getattr(args, "parts", "local,published,tuner").split(",")}
    import os
    # timed steps after 3 warm-up rounds unless told otherwise: 12 for the calibrated and held-out
    # cases (32 of them, ~200 s on 2 loaded cores), 24 (3 blocks of 8) for the tuner's table
    steps = args.steps or 24
    warmup = getattr(args, "warmup", 0) or 3
    # how busy the machine was: step-time figures mean little when other jobs hold the cores
    result: dict = {"cores": os.cpu_count(), "load_average_start": os.getloadavg()[0]}
    if "local" in parts:
        from .planner_local import local_part
        local, _ = local_part(args.steps or 12, warmup)
        result.update(local)
    if "published" in parts:
        cases = published_cases()
        result.update(published_figures(cases))
        result["published_cases"] = cases
    if "tuner" in parts:
        result.update(tuner_part(steps, warmup))
    result["load_average_end"] = os.getloadavg()[0]
    return result
