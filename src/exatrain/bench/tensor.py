"""`exatrain bench tensor`: serial vs 1D (Megatron) vs 3D (AxoNN) tensor parallelism, 4 and 8 ranks.

GPT and a ViT forecaster, wide enough that weight traffic matters (12·E² weights per block
against n·E activations per block per rank), train with SGD on identical batches. In each launch
every variant starts from the same weights, and the variants run interleaved in rounds (warm-up
first) so machine noise hits them alike:

  serial        the plain model on one process (rank 0; the other ranks wait at a barrier)
  1D            Plan(tensor=W)
  3D            Plan(tensor=(2,1,2)) on 4 ranks; (2,2,2) and data=2 × (2,1,2) (4D) on 8
  3D, no ovl.   the 4-rank 3D plan without the backward overlap and the weight prefetch

Figures (keys "<model> w<W> <plan>"):

  step_s                   median step time of the slowest rank (forward, backward, SGD step)
  samples_per_s            global batch / step_s
  bytes_by_axis            counted by the ledger per training step, per mesh axis
  bytes_formula_by_axis    the algorithms' formulas for the same step (`TensorParallel.
                           bytes_per_step`: linear1d, linear3d, gradsync, boundary conversions)
  rel_err_vs_serial        worst per-tensor max|w - w_serial| / max|w_serial| over all weights
                           after the last step (tensors that are rounding noise in the serial run,
                           max|w| < 1e-6 — the attention key bias, whose gradient is zero in exact
                           arithmetic — are listed in `noise_tensors` and left out)
  max_rel_err_vs_serial, bytes_ratio (worst counted / formula over plans and axes; 1.0 means the
  implementation issues exactly the communication its formulas promise)

`oversubscribed` is true when the ranks share fewer cores than there are ranks: each rank then
gets one thread and the times say little about a real machine, only about relative costs.
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def add_arguments(parser) -> None:
    """Extra options (read with defaults when the command line does not define them)."""
    parser.add_argument("--worlds", default="4,8", help="world sizes to run, comma-separated")
    parser.add_argument("--models", default="gpt,vit", help="gpt, vit or both")


def _plans(world: int) -> list[tuple[str, dict, dict]]:
    """(label, Plan degrees, parallelize_tensor keywords)."""
    if world == 4:
        return [("tensor=4", dict(tensor=4), {}),
                ("tensor=(2,1,2)", dict(tensor=(2, 1, 2)), {}),
                ("tensor=(2,1,2) no-overlap-prefetch", dict(tensor=(2, 1, 2)),
                 dict(overlap=False, prefetch=False))]
    if world == 8:
        return [("tensor=8", dict(tensor=8), {}),
                ("tensor=(2,2,2)", dict(tensor=(2, 2, 2)), {}),
                ("data=2 tensor=(2,1,2)", dict(data=2, tensor=(2, 1, 2)), {})]
    raise ValueError(f"--worlds: {world} ranks has no plan set; use 4 and/or 8.")


def _model(name: str, width: int):
    from ..models.gpt import GPT, GPTConfig
    from ..models.vit import ViTForecaster

    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=8, n_embd=width))
    return ViTForecaster(img_size=(32, 64), patch_size=4, in_channels=3, out_channels=3,
                         embed_dim=width, depth=2, num_heads=8, residual=False)


def _batches(name: str, batch: int, count: int):
    gen = torch.Generator().manual_seed(1)
    if name == "gpt":
        tokens = torch.randint(0, 512, (count, batch, 65), generator=gen)
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    x = torch.randn(count, batch, 3, 32, 64, generator=gen)
    return [(xi, xi.roll(1, dims=-1)) for xi in x]


def _loss(name: str):
    from ..models.gpt import gpt_loss
    from ..models.vit import relative_l2_loss
    return gpt_loss if name == "gpt" else relative_l2_loss


def _step(model, optim, loss_fn, x, y) -> float:
    t0 = time.perf_counter()
    loss_fn(model(x), y).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _rank_main(world: int, names: list[str], width: int, batch: int, steps: int,
               warmup: int) -> dict:
    import torch.distributed as dist

    from ..mesh import init
    from ..parallel.tensor import parallelize_tensor
    from ..parallel.tensor.state import full_state_dict
    from ..plan import Plan

    out: dict = {}
    for name in names:
        loss_fn = _loss(name)
        batches = _batches(name, batch, warmup + steps)
        variants = []                                        # (label, mesh, model, optim, data)
        for label, degrees, kwargs in _plans(world):
            mesh = init(Plan(**degrees))
            model = parallelize_tensor(_model(name, width), mesh, **kwargs)
            data = mesh.axis("data")
            per = batch // data.size
            rows = slice(data.rank * per, (data.rank + 1) * per)   # this data replica's part
            local = [(x[rows], y[rows]) for x, y in batches]
            variants.append((label, mesh, model, torch.optim.SGD(model.parameters(), lr=0.05),
                             local))
        serial = _model(name, width) if dist.get_rank() == 0 else None
        serial_optim = torch.optim.SGD(serial.parameters(), lr=0.05) if serial else None
        times: dict[str, list[float]] = {"serial": []}
        for label, *_ in variants:
            times[label] = []
        marks = {}
        for i in range(warmup + steps):
            if i == warmup:
                marks = {label: mesh.ledger.snapshot() for label, mesh, *_ in variants}
            dist.barrier()
            if serial is not None:
                dt = _step(serial, serial_optim, loss_fn, *batches[i])
                if i >= warmup:
                    times["serial"].append(dt)
            dist.barrier()
            for label, mesh, model, optim, local in variants:
                dt = _step(model, optim, loss_fn, *local[i])
                if i >= warmup:
                    times[label].append(dt)
                dist.barrier()
        reference = {k: v.detach().clone() for k, v in serial.state_dict().items()} \
            if serial else None
        for label, mesh, model, _optim, _local in variants:
            delta = mesh.ledger.since(marks[label])
            counted = {}
            for (axis, _op, tag), entry in delta.entries.items():
                if tag not in ("metric", "state"):
                    counted[axis] = counted.get(axis, 0) + entry.bytes
            key = f"{name} w{world} {label}"
            out[key] = {"step_s": statistics.median(times[label]),
                        "bytes_by_axis": {a: b // steps for a, b in counted.items()},
                        "bytes_formula_by_axis": model.exatrain_tensor.bytes_per_step()}
            state = full_state_dict(model)
            if reference is not None:
                errs, noise = {}, []
                for k, ref in reference.items():
                    scale = ref.double().abs().max().item()
                    if scale < 1e-6:
                        noise.append(k)
                        continue
                    errs[k] = (state[k].double() - ref.double()).abs().max().item() / scale
                out[key]["rel_err_vs_serial"] = max(errs.values())
                out[key]["noise_tensors"] = noise
        out[f"{name} w{world} serial"] = {"step_s": statistics.median(times["serial"])
                                          if times["serial"] else float("nan")}
    return out


def run(args) -> dict:
    from ..launch import spawn

    width = args.size or 256
    steps = args.steps or 8
    warmup = args.warmup
    batch = 8
    names = [n.strip() for n in getattr(args, "models", "gpt,vit").split(",") if n.strip()]
    worlds = [int(w) for w in str(getattr(args, "worlds", "4,8")).split(",") if w.strip()]
    cores = os.cpu_count() or 1
    result: dict = {"models": {"gpt": f"GPT E={width}, 2 layers, 8 heads, vocab 512, T=64",
                               "vit": f"ViT E={width}, 2 blocks, 8 heads, 32x64x3, patch 4 "
                                      "(128 tokens)"},
                    "global_batch": batch, "timed_steps": steps, "warmup_steps": warmup,
                    "cores": cores, "device": "cuda" if torch.cuda.is_available() else "cpu",
                    "step_s": {}, "samples_per_s": {}, "bytes_by_axis": {},
                    "bytes_formula_by_axis": {}, "rel_err_vs_serial": {}, "noise_tensors": {}}
    for world in worlds:
        per_rank = spawn(_rank_main, world, args=(world, names, width, batch, steps, warmup))
        result[f"w{world}_oversubscribed"] = world > cores
        for key in per_rank[0]:
            step = max(r[key]["step_s"] for r in per_rank)    # a step ends with its slowest rank
            result["step_s"][key] = step
            result["samples_per_s"][key] = batch / step
            first = per_rank[0][key]
            if "bytes_by_axis" in first:
                # every rank counts its own traffic: report the busiest rank's, per axis
                axes = {a for r in per_rank for a in r[key]["bytes_by_axis"]} | \
                    {a for r in per_rank for a in r[key]["bytes_formula_by_axis"]}
                result["bytes_by_axis"][key] = {
                    a: max(r[key]["bytes_by_axis"].get(a, 0) for r in per_rank) for a in axes}
                result["bytes_formula_by_axis"][key] = {
                    a: max(r[key]["bytes_formula_by_axis"].get(a, 0) for r in per_rank)
                    for a in axes}
                result["rel_err_vs_serial"][key] = first["rel_err_vs_serial"]
                result["noise_tensors"][key] = first["noise_tensors"]
    # counted / formula for every plan and axis where either is non-zero: the worst over-count is
    # bytes_ratio, the worst under-count bytes_ratio_min (a missed collective would show there)
    ratios = [c / result["bytes_formula_by_axis"][k][a] if result["bytes_formula_by_axis"][k][a]
              else float("inf")
              for k, counted in result["bytes_by_axis"].items() for a, c in counted.items()
              if c or result["bytes_formula_by_axis"][k][a]]
    result["bytes_ratio"] = max(ratios) if ratios else float("nan")
    result["bytes_ratio_min"] = min(ratios) if ratios else float("nan")
    result["max_rel_err_vs_serial"] = max(result["rel_err_vs_serial"].values())
    for world in worlds:
        for name in names:
            on = result["step_s"].get(f"{name} w{world} tensor=(2,1,2)")
            off = result["step_s"].get(f"{name} w{world} tensor=(2,1,2) no-overlap-prefetch")
            if on and off:
                result[f"{name}_w{world}_overlap_prefetch_speedup"] = off / on
    return result
