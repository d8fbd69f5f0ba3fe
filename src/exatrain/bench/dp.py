"""`exatrain bench dp`: exatrain data parallelism vs plain PyTorch DDP, same model, data and loop.

Two ranks (gloo on CPU, NCCL on GPUs). Both variants start from the same weights, see the same
batches of real CosmoFlow data and run the same training loop; only the wrapper differs:

  ddp        torch.nn.parallel.DistributedDataParallel, default all-reduce
  exatrain   exatrain.parallelize (DDP's reducer with exatrain's ledger-recording comm hook)
  local      the same model and loop with no gradient synchronisation: the compute-only limit that
             perfect overlap of communication with backward could reach

Variants run interleaved step by step so that machine noise hits all of them alike; a step ends
when the slower rank finishes it, and each figure is the median of those over the timed steps
after warm-up. Writes ddp_step_s, exatrain_step_s, ratio_vs_ddp (exatrain / DDP, lower is better),
local_step_s, ratio_vs_local, allreduce_bytes_per_step (counted by the ledger) and
allreduce_bytes_min (= the gradient bytes, 4 B per fp32 parameter).

Exposed communication per case (`<case>_exposed_comm_fraction`, of that case's step time):
exatrain's is measured by its comm layer (time blocked in exatrain.comm plus the all-reduce tail
after the last gradient bucket, see exatrain.comm.timing), median over timed steps; DDP has no such
hook, so its figure is the step time above the compute-only `local` step, (ddp - local) / ddp, and
exatrain's is given that way too (`exatrain_exposed_comm_fraction_vs_local`) to compare like with
like; `local` communicates nothing: 0.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


def add_arguments(parser) -> None:  # the shared --steps/--warmup/--size suffice
    pass


def _rank_main(size: int, steps: int, warmup: int, batch: int, data_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from ..data.cosmoflow import CosmoFlowDataset
    from ..mesh import init
    from ..models.cosmoflow import CosmoFlow
    from ..parallel import parallelize
    from ..plan import Plan

    mesh = init(Plan(data=2))
    try:
        data = CosmoFlowDataset(f"{data_dir}/train.h5")
        r = mesh.rank
        batches = [tuple(torch.stack(t).to(mesh.device) for t in zip(
            *[data[(i * 2 * batch + r * batch + j) % len(data)] for j in range(batch)]))
            for i in range(4)]

        def fresh():
            torch.manual_seed(0)
            return CosmoFlow(size=size).to(mesh.device)

        models = {"ddp": DistributedDataParallel(fresh(), process_group=mesh.axis("data").group,
                                                 gradient_as_bucket_view=True),
                  "exatrain": parallelize(fresh(), mesh),
                  "local": fresh()}
        optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
        times = {k: [] for k in models}
        exposed: list[float] = []  # exatrain's measured exposed communication per timed step

        def step(name, i):
            x, y = batches[i % len(batches)]
            mesh.ledger.drain_async_tail()
            blocked0 = mesh.ledger.blocked_total()
            t0 = time.perf_counter()
            loss = F.mse_loss(models[name](x), y)
            loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
            if name == "exatrain":
                exposed.append(mesh.ledger.blocked_total() - blocked0
                               + mesh.ledger.drain_async_tail())
            return time.perf_counter() - t0

        for name in models:
            for i in range(warmup):
                step(name, i)
        mesh.ledger.reset()
        exposed.clear()
        for i in range(steps):  # interleaved step by step, so drifts in machine load hit all alike
            for name in models:
                mesh.barrier()
                times[name].append(step(name, i))
        counted = mesh.ledger.bytes_by_axis(tag="grad").get("data", 0) / steps
        grad_bytes = sum(p.numel() * p.element_size() for p in models["local"].parameters())
        return {"times": times, "exposed": exposed, "allreduce_bytes_per_step": int(counted),
                "allreduce_bytes_min": grad_bytes, "timed_steps": steps}
    finally:
        mesh.close()


def run(args) -> dict:
    from ..data.cosmoflow_synth import write_cosmoflow
    from ..launch import spawn

    size = args.size or 32
    steps = args.steps or 20
    batch = 4
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-dp-") as tmp:
        write_cosmoflow(tmp, samples=32, size=size, seed=7)
        per_rank = spawn(_rank_main, 2, args=(size, steps, args.warmup, batch, tmp))
    # Each rank timed its own steps; a step ends when the slowest rank finishes it.
    result = {f"{name}_step_s": statistics.median(
        max(r["times"][name][i] for r in per_rank) for i in range(steps))
        for name in ("ddp", "exatrain", "local")}
    result.update({k: per_rank[0][k] for k in ("allreduce_bytes_per_step", "allreduce_bytes_min",
                                               "timed_steps")})
    result.update(ranks=2, model=f"CosmoFlow {size}^3", batch_per_rank=batch,
                  device=str(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                  ratio_vs_ddp=result["exatrain_step_s"] / result["ddp_step_s"],
                  ratio_vs_local=result["exatrain_step_s"] / result["local_step_s"],
                  bytes_ratio=result["allreduce_bytes_per_step"] / result["allreduce_bytes_min"])
    # exposed communication per case (see the module docstring for how each is obtained)
    result["exatrain_exposed_comm_s"] = statistics.median(
        max(r["exposed"][i] for r in per_rank) for i in range(steps))
    result["exatrain_exposed_comm_fraction"] = statistics.median(
        max(r["exposed"][i] / r["times"]["exatrain"][i] for r in per_rank) for i in range(steps))
    for name in ("ddp", "exatrain"):
        key = f"{name}_exposed_comm_fraction" + ("_vs_local" if name == "exatrain" else "")
        result[key] = max(0.0, 1 - result["local_step_s"] / result[f"{name}_step_s"])
    result["local_exposed_comm_fraction"] = 0.0
    return result
