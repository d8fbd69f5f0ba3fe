"""`exatrain bench chanfilt`: channel/filter parallelism against data and space, CosmoFlow and DeepCAM.

Models with wide late layers: CosmoFlow with 4× the MLPerf channel counts (base 128: 128 → 2048
channels, no BatchNorm, as MLPerf's) on a small volume so it runs on a CPU, and DeepCAM (width 32,
16 input channels). Every variant trains with SGD (momentum 0.9) on the same batches from the
same weights; the serial model runs on rank 0 first (the other ranks wait):

  2 ranks (timed)   data=2, space=(1,1,2), tensor=2
  4 ranks           data=2 × tensor=2 (the gradient all-reduce of split layers falls by 2) and,
                    CosmoFlow only, space=(1,1,2) × tensor=2 (the switch point of
                    parallel/tensor/switch.py; DeepCAM ends without a Flatten and is refused)

Figures per case ("<model> <plan>"), per rank and training step (the busiest rank):

  max_rel_err_vs_serial          worst per-tensor max|w - w_serial| / max|w_serial| after the steps
                                 (BatchNorm shifts, whose gradients are cancellation noise, apart:
                                 bn_shift_max_abs_diff)
  tensor_bytes_per_step          counted by the ledger on the `tensor` axis
  tensor_bytes_formula           `TensorParallel.bytes_per_step()` (conv.py, linear1d.py, gradsync)
  grad_allreduce_bytes_per_rank  ledger bytes with tag "grad" (DDP's or GradSync's all-reduce)
  state_bytes_per_rank           parameters + gradients + SGD momentum held by the rank
  peak_activation_bytes          bytes autograd saves for backward in one forward (saved-tensor hooks)
  step_s                         median step time after warm-up (slowest rank); 4-rank cases
                                 on a machine with fewer cores are flagged `oversubscribed`

and per model, data=2 against data=2 × tensor=2 (4 ranks):

  <model>_grad_allreduce_fall_data_vs_data_tensor   the whole model's ledger "grad" bytes, ratio
  <model>_split_grad_allreduce_bytes_per_rank       the split layers' share of them: each case's
                                 ledger "grad" bytes less the bytes of the parameters tensor leaves
                                 whole (all-reduced once, at their size, in both cases)
  <model>_split_grad_allreduce_fall                 their ratio: t when the split weights'
                                 gradients are reduced once, at 1/t of their size
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F


def add_arguments(parser) -> None:
    parser.add_argument("--channels", type=int, default=128,
                        help="CosmoFlow base channels (MLPerf: 32; default 4x that)")
    parser.add_argument("--models", default="cosmoflow,deepcam", help="cosmoflow, deepcam or both")
    parser.add_argument("--worlds", default="2,4", help="2 (timed cases), 4 (bytes cases) or both")
    parser.add_argument("--batch", type=int, default=2, help="global batch")


def _plans(world: int, name: str) -> list[tuple[str, dict]]:
    if world == 2:
        return [("data=2", dict(data=2)), ("space=(1,1,2)", dict(space=(1, 1, 2))),
                ("tensor=2", dict(tensor=2))]
    plans = [("data=2 tensor=2", dict(data=2, tensor=2))]
    if name == "cosmoflow":
        plans.append(("space=(1,1,2) tensor=2", dict(space=(1, 1, 2), tensor=2)))
    return plans


def _model(name: str, size: int, channels: int):
    from ..models.cosmoflow import CosmoFlow
    from ..models.deepcam import DeepCAM

    torch.manual_seed(0)
    if name == "cosmoflow":
        return CosmoFlow(size=size, base_channels=channels, conv_layers=5)
    return DeepCAM(in_channels=16, width=32, dropout=0.0)


def _batches(name: str, size: int, batch: int, count: int):
    gen = torch.Generator().manual_seed(1)
    if name == "cosmoflow":
        return [(torch.randn(batch, 4, size, size, size, generator=gen),
                 torch.rand(batch, 4, generator=gen) - 0.5) for _ in range(count)]
    h, w = 2 * size, 3 * size
    return [(torch.randn(batch, 16, h, w, generator=gen),
             torch.randint(0, 3, (batch, h, w), generator=gen)) for _ in range(count)]


def _local(mesh, x, y):
    """This rank's part of a global batch: its data replica's rows, its spatial block."""
    from ..parallel.spatial import block_region, split_input

    data = mesh.axis("data")
    per = x.shape[0] // data.size
    rows = slice(data.rank * per, (data.rank + 1) * per)
    x, y = x[rows], y[rows]
    whole = y.numel()
    if mesh.plan.space_degree > 1:
        x = split_input(x, mesh)
        if y.dim() == 3:                                   # DeepCAM's labels: blocks too
            y = y[(slice(None), *block_region(tuple(y.shape[1:]), mesh))]
    return x, y, whole


def _loss(name: str, out, y, whole: int):
    """The replica's mean loss; under space each rank adds its block's share (summed by the
    gradient reduction over space)."""
    if name == "cosmoflow":
        return F.mse_loss(out, y)
    return F.cross_entropy(out, y, reduction="sum") / whole


def _saved_bytes(model, x) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def _full_state(model):
    from ..parallel import unwrap
    from ..parallel.tensor.state import full_state_dict

    inner = unwrap(model)
    if getattr(inner, "exatrain_tensor", None) is not None:
        return full_state_dict(inner)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _train(model, name, batches, local, warmup, steps, ledger=None):
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times, mark = [], None
    for i, (x, y) in enumerate(batches):
        if i == warmup and ledger is not None:
            mark = ledger.snapshot()
        xl, yl, whole = local(x, y)
        t0 = time.perf_counter()
        _loss(name, model(xl), yl, whole).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, mark, optim


def _rank_main(world: int, names: list[str], size: int, channels: int, batch: int, steps: int,
               warmup: int) -> dict:
    import torch.distributed as dist

    from ..mesh import init
    from ..parallel import parallelize
    from ..plan import Plan

    out: dict = {}
    for name in names:
        batches = _batches(name, size, batch, warmup + steps)
        reference = None
        mesh0 = init(Plan(data=world))
        if mesh0.rank == 0:
            serial = _model(name, size, channels)
            times, _, _ = _train(serial, name, batches, lambda x, y: (x, y, y.numel()), warmup,
                                 steps)
            reference = {k: v.detach().clone() for k, v in serial.state_dict().items()}
            out[f"{name} serial"] = {"step_s": statistics.median(times),
                                     "peak_activation_bytes": _saved_bytes(serial, batches[0][0]),
                                     "state_bytes_per_rank": 3 * sum(
                                         p.numel() * p.element_size() for p in serial.parameters())}
            del serial
        dist.barrier()
        mesh0.close()
        for label, degrees in _plans(world, name):
            mesh = init(Plan(**degrees))
            model = parallelize(_model(name, size, channels), mesh)
            local = lambda x, y, mesh=mesh: _local(mesh, x, y)  # noqa: E731
            dist.barrier()
            times, mark, _optim = _train(model, name, batches, local, warmup, steps, mesh.ledger)
            delta = mesh.ledger.since(mark)
            per_step = lambda tag=None, axis=None: sum(  # noqa: E731
                e.bytes for (a, _op, t), e in delta.entries.items()
                if (tag is None or t == tag) and (axis is None or a == axis)
                and t not in ("metric", "state")) // steps
            from ..parallel import unwrap
            inner = unwrap(model)
            tp = getattr(inner, "exatrain_tensor", None)
            split = [n for n, p in inner.named_parameters() if getattr(p, "exatrain_layout", ())]
            state = _full_state(model)      # before the forward below moves BatchNorm's statistics
            xl, _yl, _w = local(*batches[0])
            figures = {
                "step_s": statistics.median(times),
                "tensor_bytes_per_step": per_step(axis="tensor"),
                "tensor_bytes_formula": tp.bytes_per_step().get("tensor", 0) if tp else 0,
                "grad_allreduce_bytes_per_rank": per_step(tag="grad"),
                "bytes_by_axis": {a: b // steps for a, b in delta.bytes_by_axis().items()},
                "param_bytes": {n: p.numel() * p.element_size()
                                for n, p in inner.named_parameters()},
                "split_params": split,
                "state_bytes_per_rank": 3 * sum(p.numel() * p.element_size()
                                                for p in model.parameters()),
                "peak_activation_bytes": _saved_bytes(model, xl),
                "conv_pairs": tp.summary()["conv_pairs"] if tp else [],
            }
            if reference is not None:
                # BatchNorm shifts: their gradients are cancellation noise (tests/
                # test_deepcam_workload.py), compared in absolute terms
                shifts = {k for k in reference
                          if k.endswith(".bias") and k[:-4] + "running_mean" in reference}
                errs = [float((state[k].double() - v.double()).abs().max()
                              / v.double().abs().max().clamp_min(1e-30))
                        for k, v in reference.items() if v.is_floating_point()
                        and v.double().abs().max() > 1e-6 and k not in shifts]
                figures["max_rel_err_vs_serial"] = max(errs)
                figures["bn_shift_max_abs_diff"] = max(
                    (float((state[k] - reference[k]).abs().max()) for k in shifts), default=0.0)
            out[f"{name} {label}"] = figures
            del model
            mesh.close()
    return out


def run(args) -> dict:
    from ..launch import spawn

    size = args.size or 32
    steps = args.steps or 3
    warmup = args.warmup if args.warmup is not None else 1
    channels = getattr(args, "channels", 128)
    batch = getattr(args, "batch", 2)
    names = [n.strip() for n in getattr(args, "models", "cosmoflow,deepcam").split(",") if n]
    worlds = [int(w) for w in str(getattr(args, "worlds", "2,4")).split(",") if w.strip()]
    cores = os.cpu_count() or 1
    result: dict = {"models": {"cosmoflow": f"CosmoFlow {size}^3, 5 conv layers, channels "
                                            f"{channels}..{channels * 16} ({channels // 32}x MLPerf)",
                               "deepcam": f"DeepCAM width 32, 16x{2 * size}x{3 * size}"},
                    "global_batch": batch, "timed_steps": steps, "warmup_steps": warmup,
                    "cores": cores, "load_1min": os.getloadavg()[0]}
    cases: dict = {}
    for world in worlds:
        per_rank = spawn(_rank_main, world, args=(world, names, size, channels, batch, steps,
                                                  warmup))
        for key, first in per_rank[0].items():
            if key in cases:        # the serial run of an earlier (not oversubscribed) launch
                continue
            case = dict(first)
            case["world"] = world
            case["oversubscribed"] = world > cores
            if "step_s" in first and key.split(" ", 1)[1] != "serial":
                case["step_s"] = max(r[key]["step_s"] for r in per_rank)
                for fig in ("tensor_bytes_per_step", "tensor_bytes_formula",
                            "grad_allreduce_bytes_per_rank", "state_bytes_per_rank",
                            "peak_activation_bytes"):
                    case[fig] = max(r[key][fig] for r in per_rank)
            cases[key] = case
    ratios = [c["tensor_bytes_per_step"] / c["tensor_bytes_formula"] for c in cases.values()
              if c.get("tensor_bytes_formula")]
    result["tensor_bytes_ratio_max"] = max(ratios) if ratios else float("nan")
    result["tensor_bytes_ratio_min"] = min(ratios) if ratios else float("nan")
    result["max_rel_err_vs_serial_all"] = max((c.get("max_rel_err_vs_serial", 0.0)
                                           for c in cases.values()), default=float("nan"))
    for name in names:
        serial = cases.get(f"{name} serial", {})
        for key, c in cases.items():
            if key.startswith(name + " ") and serial.get("step_s") and "serial" not in key:
                c["speedup_vs_serial"] = serial["step_s"] / c["step_s"]
                c["state_ratio_vs_serial"] = c["state_bytes_per_rank"] / serial[
                    "state_bytes_per_rank"]
        data, dt = cases.get(f"{name} data=2"), cases.get(f"{name} data=2 tensor=2")
        if data and dt and dt["grad_allreduce_bytes_per_rank"]:
            result[f"{name}_grad_allreduce_fall_data_vs_data_tensor"] = (
                data["grad_allreduce_bytes_per_rank"] / dt["grad_allreduce_bytes_per_rank"])
            split = set(dt["split_params"])
            layers = [c["grad_allreduce_bytes_per_rank"] - sum(
                b for n, b in c["param_bytes"].items() if n not in split) for c in (data, dt)]
            if split and layers[1] > 0:
                result[f"{name}_split_grad_allreduce_bytes_per_rank"] = {
                    "data=2": layers[0], "data=2 tensor=2": layers[1]}
                result[f"{name}_split_grad_allreduce_fall"] = layers[0] / layers[1]
    for c in cases.values():            # inputs of the figure above, not figures themselves
        c.pop("param_bytes", None)
        c.pop("split_params", None)
    figures = sorted({f for c in cases.values() for f in c})
    for fig in figures:                 # one entry per figure: {case: value}
        result[fig] = {k: c[fig] for k, c in cases.items() if fig in c}
    return result
