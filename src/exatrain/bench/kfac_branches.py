"""`exatrain bench kfac`, part 2, sub-graph parallelism (2 ranks): DeepCAM (`--deepcam-size`²,
width `--deepcam-width`) under Plan(data=2), and the same with parallel.branches = "data" (ASPP's branches split over the
two ranks), interleaved step by step from the same weights on the same batches:
`deepcam_data_step_s`, `deepcam_branches_step_s`, their ratio, the branch bytes per step, and
for both layouts `deepcam_<layout>_max_rel_err_vs_serial` (outputs of the first step and every
state entry after the steps, against the serial model on the whole batch, computed in this
process), with the entry where it is worst (`..._worst_state_entry`) and the whole state's
relative norm error (`..._state_rel_norm_err_vs_serial`, ‖Δ‖ / ‖serial‖ over all entries): plain
data parallelism beside the branches separates what float32's reordered sums do over the steps
from the branches. The two layouts are also compared with each other, rank by rank:
`deepcam_branches_vs_data_max_rel_err` (and its `..._worst_state_entry`),
`..._rel_err_in_data_worst_entry` (in the entry where data parallelism is furthest from serial),
`..._state_rel_norm_err` and `..._output_rel_err_step1`.
"""

from __future__ import annotations

import statistics
import time

import torch


def _deepcam_model(size_w: int):
    from ..models.deepcam import DeepCAM
    torch.manual_seed(0)
    return DeepCAM(in_channels=4, num_classes=3, width=size_w, dropout=0.0)


def _deepcam_rank(size: int, width: int, steps: int, warmup: int, batch: int) -> dict:
    from ..mesh import init
    from ..parallel import parallelize, unwrap
    from ..parallel.options import ParallelOptions
    from ..plan import Plan

    mesh = init(Plan(data=2))
    try:
        g = torch.Generator().manual_seed(3)
        xs = torch.randn(steps + warmup, batch, 4, size, size, generator=g)
        mine = slice(mesh.rank * batch // 2, (mesh.rank + 1) * batch // 2)
        models = {name: parallelize(_deepcam_model(width), mesh, ParallelOptions(branches=mode))
                  for name, mode in (("data", "none"), ("branches", "data"))}
        opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
        times = {n: [] for n in models}
        first_out = {}
        marks = {}
        for step in range(steps + warmup):
            for name, model in models.items():
                mark = mesh.ledger.snapshot()
                t0 = time.perf_counter()
                out = model(xs[step][mine].to(mesh.device))
                (out.float() ** 2).mean().backward()
                opts[name].step()
                opts[name].zero_grad()
                dt = time.perf_counter() - t0
                if step >= warmup:
                    times[name].append(dt)
                if step == 0:
                    first_out[name] = out.detach().cpu()
                marks[name] = mesh.ledger.since(mark).bytes_by_axis(tag="branch").get("data", 0)
        return {"times": times, "first_out": first_out,
                "state": {name: {k: v.detach().cpu().clone()
                                 for k, v in unwrap(m).state_dict().items()}
                          for name, m in models.items()},
                "branch_bytes": marks["branches"]}
    finally:
        mesh.close()


def branch_figures(args, launch) -> dict:
    """Part 2's figures (module doc): both layouts on 2 ranks, then the serial run here."""
    result: dict = {}
    b, s, w = 4, args.deepcam_size, args.deepcam_width
    ranks = launch(_deepcam_rank, 2, args=(s, w, args.deepcam_steps, args.warmup, b))
    for name in ("data", "branches"):
        result[f"deepcam_{name}_step_s"] = statistics.median(
            max(r["times"][name][i] for r in ranks) for i in range(args.deepcam_steps))
    result["deepcam_branches_vs_data"] = (result["deepcam_branches_step_s"]
                                          / result["deepcam_data_step_s"])
    result["deepcam_branch_bytes_per_step"] = ranks[0]["branch_bytes"]
    # serial: the same model, the same batches, the whole batch in one process
    model = _deepcam_model(w)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(args.deepcam_steps + args.warmup, b, 4, s, s, generator=g)
    first_err = {}
    for step in range(len(xs)):
        out = model(xs[step])
        if step == 0:
            ref = out.detach()
            for name in ("data", "branches"):
                full = torch.cat([r["first_out"][name] for r in ranks])
                first_err[name] = float((full - ref).abs().max() / ref.abs().max())
        (out ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    # plain data parallelism is measured beside the branches against the same serial run:
    # what both show is float32's reordered sums amplified by the steps, not the branches
    worst_vs_serial = {}
    for name in ("data", "branches"):
        errs = _entry_errors([r["state"][name] for r in ranks], state)
        worst = worst_vs_serial[name] = max(errs, key=errs.get)
        result[f"deepcam_{name}_max_rel_err_vs_serial"] = max(first_err[name], errs[worst])
        result[f"deepcam_{name}_worst_state_entry"] = worst
        result[f"deepcam_{name}_output_rel_err_step1"] = first_err[name]
        result[f"deepcam_{name}_state_rel_norm_err_vs_serial"] = max(
            norm_error(r["state"][name], state) for r in ranks)
    # the two layouts against each other, rank by rank (the same batches and weights): how
    # much of the error vs serial the branches add to plain data parallelism's
    between: dict[str, float] = {}
    for r in ranks:
        for k, e in _entry_errors([r["state"]["branches"]], r["state"]["data"]).items():
            between[k] = max(between.get(k, 0.0), e)
    worst = max(between, key=between.get)
    result["deepcam_branches_vs_data_max_rel_err"] = between[worst]
    result["deepcam_branches_vs_data_worst_state_entry"] = worst
    result["deepcam_branches_vs_data_rel_err_in_data_worst_entry"] = \
        between[worst_vs_serial["data"]]
    result["deepcam_branches_vs_data_state_rel_norm_err"] = max(
        norm_error(r["state"]["branches"], r["state"]["data"]) for r in ranks)
    result["deepcam_branches_vs_data_output_rel_err_step1"] = max(
        float((r["first_out"]["branches"] - r["first_out"]["data"]).abs().max()
              / r["first_out"]["data"].abs().max()) for r in ranks)
    result["deepcam"] = f"DeepCAM {s}x{s}, width {w}, batch {b} (2 per rank)"
    return result


def _entry_errors(states: list[dict], ref: dict) -> dict[str, float]:
    """Per floating-point entry of `ref`: the largest |state - ref| / max |ref| over `states`."""
    return {k: max(float((st[k].double() - v.double()).abs().max()
                         / v.double().abs().max().clamp_min(1e-30)) for st in states)
            for k, v in ref.items() if v.is_floating_point()}


def norm_error(state: dict, ref: dict) -> float:
    """‖state - ref‖ / ‖ref‖ over all floating-point entries together (the whole state)."""
    keys = [k for k, v in ref.items() if v.is_floating_point()]
    diff = sum(float((state[k].double() - ref[k].double()).pow(2).sum()) for k in keys)
    norm = sum(float(ref[k].double().pow(2).sum()) for k in keys)
    return (diff / max(norm, 1e-300)) ** 0.5
