"""`exatrain bench spatial`: CosmoFlow serial vs split over the `space` axis on 2 and 4 ranks.

Same model (CosmoFlow, 128³ × 4 by default: 8.9 M parameters, ~0.9 GB of activations per sample),
same weights, same real CosmoFlow sample(s), same training step (forward, MSE loss, backward,
AdamW); only the layout differs:

  serial    the plain model on one process using both cores (2 threads), in the same launch
  spatial   exatrain.parallelize under Plan(space=(2, 1, 1)): each of 2 ranks (1 thread each)
            holds half of every cube, exchanging halos with its neighbour
  overlap   the same, computing each convolution's interior while its halos travel
  4 ranks   Plan(space=(2, 2, 1)): correctness, halo bytes and activation memory only. Four
            ranks on this 2-core machine would time oversubscription, not the algorithm.

Figures, per rank count n in (2, 4) (suffix `_{n}ranks`; unsuffixed ones are for 2 ranks):
  max_rel_err_vs_serial     max over output, loss and every weight gradient (after the gradient
                            all-reduce) of max|spatial - serial| / max|serial|, first step, float32
  max_rel_err_vs_serial_fp64  the same step in float64: the error of the algorithm itself
  serial_fp32_rel_err_vs_fp64 / spatial_fp32_rel_err_vs_fp64  how far each float32 gradient is
                            from the float64 one. At 128³ a first-layer weight gradient sums
                            2 M products with cancellation, so float32 gradients are only good to
                            ~1e-2 relative, serial and spatial alike: max_rel_err_vs_serial
                            measures that rounding, not a difference of algorithm
  halo_bytes_per_step       bytes received by all ranks in halo messages in one training step
                            (forward and backward), counted by the comm ledger
  halo_bytes_min            the analytic halo volume: for every convolution and pooling layer
                            and every rank, the input elements its outputs read that it neither
                            owns nor gets as zero padding (from the layer geometry, independent
                            of the code under test), forward, and again backward where the
                            layer's input needs a gradient (all but the first layer)
  activation_bytes_per_rank the largest rank's activation memory: bytes of the distinct tensors
  activation_bytes_serial   autograd keeps alive for backward, summed at the end of the forward
                            pass (saved-tensor hooks; parameters excluded). That is the peak of
                            activation memory: backward frees them as it goes. Transient
                            workspace inside a single op is not included (the same for both).
  input_bytes_read_per_rank HDF5 bytes each rank read for one step's batch (its block only)
  step_s_serial / step_s_spatial / step_s_spatial_overlap  medians of the timed steps, each step
                            lasting until the slower rank finishes; variants interleaved step
                            by step so load drift hits all alike
  exposed_comm_fraction_{serial,spatial,spatial_overlap}  the part of each step a rank spent
                            blocked in exatrain.comm (halo waits, gradient all-reduce), measured
                            (exatrain.comm.timing), of its step time; worst rank, median of steps;
                            serial communicates nothing: 0
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.spatial.volume import analytic_halo_bytes  # the formula, shared with the planner


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")


# ---------------------------------------------------------------------------- measurements
def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward; runs backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        loss = F.mse_loss(out, y)
    total = sum(saved.values())
    loss.backward()
    return total, out.detach(), loss.detach()


# ---------------------------------------------------------------------------- one launch
def _rank_main(size: int, batch: int, steps: int, warmup: int, data_dir: str, space: tuple,
               timing: bool) -> dict:
    from ..comm import all_reduce
    from ..data.cosmoflow import CosmoFlowDataset
    from ..mesh import init
    from ..models.cosmoflow import CosmoFlow
    from ..parallel import parallelize, unwrap
    from ..parallel.spatial import SpatialBlocks, block_region
    from ..plan import Plan

    mesh = init(Plan(space=space))
    try:
        full = CosmoFlowDataset(f"{data_dir}/train.h5")
        blocks = SpatialBlocks(CosmoFlowDataset(f"{data_dir}/train.h5"),
                               block_region((size,) * 3, mesh))
        xb, y = (torch.stack(t) for t in zip(*[blocks[i] for i in range(batch)]))
        read_per_rank = blocks.bytes_read
        torch.manual_seed(0)
        serial = CosmoFlow(size=size)
        model = parallelize(copy.deepcopy(serial), mesh)
        out: dict = {"input_bytes_read_per_rank": read_per_rank}

        # correctness, memory and halo bytes of one step; the serial reference on rank 0
        if mesh.rank == 0:
            x, _ = (torch.stack(t) for t in zip(*[full[i] for i in range(batch)]))
            torch.set_num_threads(2)
            act_serial, out_serial, loss_serial = activation_bytes(serial, x, y)
            torch.set_num_threads(1)
            out["activation_bytes_serial"] = act_serial
            out["analytic"] = analytic_halo_bytes(serial, tuple(x.shape), space)
            del x
        mesh.barrier()
        before = mesh.ledger.snapshot()
        act, out_spatial, loss_spatial = activation_bytes(model, xb, y)
        halo = sum(e.bytes for (axis, op, tag), e in mesh.ledger.since(before).entries.items()
                   if op == "recv" and tag == "halo")
        counted = torch.tensor([float(halo), float(act)], dtype=torch.float64)
        all_reduce(counted[:1], mesh.world)
        peak = counted[1:].clone()
        all_reduce(peak, mesh.world, op=torch.distributed.ReduceOp.MAX)
        out["halo_bytes_per_step"] = int(counted[0])
        out["activation_bytes_per_rank"] = int(peak[0])
        if mesh.rank == 0:
            errs = [_rel(out_spatial, out_serial), _rel(loss_spatial, loss_serial)]
            errs += [_rel(p.grad, q.grad) for p, q in zip(unwrap(model).parameters(),
                                                         serial.parameters())]
            out["max_rel_err_vs_serial"] = max(errs)

        # the same step in float64: the algorithm's own error, and float32's rounding floor
        serial64 = copy.deepcopy(serial).double()
        model64 = parallelize(copy.deepcopy(serial64), mesh)
        F.mse_loss(model64(xb.double()), y.double()).backward()
        if mesh.rank == 0:
            x64 = torch.stack([full[i][0] for i in range(batch)]).double()
            torch.set_num_threads(2)
            F.mse_loss(serial64(x64), y.double()).backward()
            torch.set_num_threads(1)
            del x64
            out["max_rel_err_vs_serial_fp64"] = max(
                _rel(p.grad, q.grad) for p, q in zip(unwrap(model64).parameters(),
                                                     serial64.parameters()))
            out["serial_fp32_rel_err_vs_fp64"] = max(
                _rel(p.grad, q.grad) for p, q in zip(serial.parameters(), serial64.parameters()))
            out["spatial_fp32_rel_err_vs_fp64"] = max(
                _rel(p.grad, q.grad) for p, q in zip(unwrap(model).parameters(),
                                                     serial64.parameters()))
        del serial64, model64

        if timing:
            runtime = unwrap(model).spatial_runtime
            optims = {"serial": torch.optim.AdamW(serial.parameters(), lr=1e-4),
                      "spatial": torch.optim.AdamW(model.parameters(), lr=1e-4)}
            times: dict[str, list[float]] = {"serial": [], "spatial": [], "spatial_overlap": []}
            # measured by exatrain.comm: seconds blocked in halo exchange and gradient sums
            exposed: dict[str, list[float]] = {name: [] for name in times}

            def step(name):
                mesh.barrier()
                if name == "serial":
                    if mesh.rank != 0:
                        mesh.barrier()
                        return None
                    torch.set_num_threads(2)
                    net, inp, opt = serial, x_serial, optims["serial"]
                else:
                    runtime.overlap = name == "spatial_overlap"
                    net, inp, opt = model, xb, optims["spatial"]
                blocked0 = mesh.ledger.blocked_total()
                t0 = time.perf_counter()
                F.mse_loss(net(inp), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                exposed[name].append(mesh.ledger.blocked_total() - blocked0)
                if name == "serial":
                    torch.set_num_threads(1)
                    mesh.barrier()
                return dt

            x_serial = None
            if mesh.rank == 0:
                x_serial = torch.stack([full[i][0] for i in range(batch)])
            for _ in range(warmup):
                for name in times:
                    step(name)
            for name in times:
                exposed[name].clear()
            for _ in range(steps):
                for name in times:
                    times[name].append(step(name))
            out["times"], out["exposed"] = times, exposed
        return out
    finally:
        mesh.close()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run(args) -> dict:
    from ..data.cosmoflow_synth import write_cosmoflow
    from ..launch import spawn

    size = args.size or 128
    steps = args.steps or 5
    warmup = args.warmup
    batch = getattr(args, "batch", 1) or 1
    result: dict = {"model": f"CosmoFlow {size}^3 x 4", "batch": batch, "ranks": [2, 4],
                    "device": "cpu", "threads_serial": 2, "threads_per_rank": 1}
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-spatial-") as tmp:
        write_cosmoflow(tmp, samples=batch + 1, size=size, seed=7, val_fraction=0.0)
        for n, space, timing in ((2, (2, 1, 1), True), (4, (2, 2, 1), False)):
            per_rank = spawn(_rank_main, n, args=(size, batch, steps, warmup, tmp, space, timing))
            r0 = per_rank[0]
            suffix = f"_{n}ranks"
            result[f"space{suffix}"] = list(space)
            for key in ("max_rel_err_vs_serial", "max_rel_err_vs_serial_fp64",
                        "serial_fp32_rel_err_vs_fp64", "spatial_fp32_rel_err_vs_fp64",
                        "halo_bytes_per_step", "activation_bytes_per_rank",
                        "activation_bytes_serial", "input_bytes_read_per_rank"):
                result[key + suffix] = r0[key]
            result["halo_bytes_min" + suffix] = r0["analytic"]
            result["halo_ratio" + suffix] = r0["halo_bytes_per_step"] / max(r0["analytic"], 1)
            result["activation_ratio" + suffix] = (r0["activation_bytes_per_rank"]
                                                   / (r0["activation_bytes_serial"] / n))
            if timing:
                for name in ("serial", "spatial", "spatial_overlap"):
                    per_step = [max(t for t in (r["times"][name][i] for r in per_rank) if t is not None)
                                for i in range(steps)]
                    result[f"step_s_{name}"] = statistics.median(per_step)
                    # of each rank's own step time, worst rank, median over steps
                    result[f"exposed_comm_fraction_{name}"] = statistics.median(
                        max(r["exposed"][name][i] / r["times"][name][i] for r in per_rank
                            if r["times"][name][i] is not None) for i in range(steps))
    result["input_bytes_per_sample"] = size ** 3 * 4 * 2
    for key in ("max_rel_err_vs_serial", "halo_bytes_per_step", "halo_bytes_min",
                "activation_bytes_per_rank", "activation_bytes_serial", "halo_ratio",
                "activation_ratio"):
        result[key] = result[key + "_2ranks"]
    for key in ("max_rel_err_vs_serial", "max_rel_err_vs_serial_fp64",
                "serial_fp32_rel_err_vs_fp64"):
        result[key] = max(result[key + "_2ranks"], result[key + "_4ranks"])
    result["speedup_spatial_vs_serial"] = result["step_s_serial"] / result["step_s_spatial"]
    result["speedup_overlap_vs_plain"] = result["step_s_spatial"] / result["step_s_spatial_overlap"]
    result["timed_steps"] = steps
    return result
