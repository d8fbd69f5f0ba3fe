"""`exatrain bench zero`: model-state memory and step time of ZeRO stages 0-3 against plain FSDP2.

A GPT whose optimizer state dominates its memory (wide layers, byte vocabulary, short sequences,
two sequences per rank) trains with AdamW (fp32) on 2 and then 4 ranks. In each launch five
variants start from the same weights and see the same batches:

  stage0   plain data parallelism (DDP with exatrain's ledger hook) over all ranks
  stage1   ZeRO-1: optimizer state sharded                    (parallel.zero.ZeroDataParallel) 
  stage2   ZeRO-2: optimizer state and gradients sharded      (parallel.zero.ZeroDataParallel) 
  stage3   ZeRO-3: exatrain's FSDP2 layout, collectives through the ledger (parallel.shard)
  fsdp2    the baseline: torch's `fully_shard` on each block and the root, default settings

They run interleaved (warm-up first, then rounds of one step per variant, the order rotating from
round to round), so machine noise and cache effects hit them alike; a step time is the median
over the timed steps of each rank, and the slowest rank's median is reported.

Figures, per world size W and stage S (`wW_stageS_...`):
  state_bytes_per_rank    measured (`observe.memory_meters.state_bytes`): distinct storages of
                          parameters, gradients and optimizer state alive on the rank at the
                          optimizer step (after `step()`, before gradients are released); the
                          largest rank's
  state_bytes_formula     the ZeRO paper's, fp32 AdamW, Ψ parameters, N = W: 16Ψ, 8Ψ + 8Ψ/N,
                          4Ψ + 12Ψ/N, 16Ψ/N
  state_ratio             measured / formula (padding to whole chunks and AdamW's step counters
                          are the only excess)
  step_s, step_s_fsdp2_baseline, step_ratio_vs_fsdp2
  comm_bytes_per_step     counted by the ledger (stage 0-2 all exatrain; stage 3 through FSDP2's
                          custom-collective hooks)
`wW_oversubscribed` is true when W ranks share fewer cores than W: their times are contended
(each rank gets cores // W threads, at least one) and say little about a real machine.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

VARIANTS = ("stage0", "stage1", "stage2", "stage3", "fsdp2")


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", default="2,4", help="world sizes to run, comma-separated")


def _model_config(size: int):
    from ..models.gpt import GPTConfig
    width = size or 384
    return GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=max(1, width // 64),
                     n_embd=width, bias=True)


def _rank_main(world: int, size: int, steps: int, warmup: int, batch: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from ..mesh import init
    from ..models.gpt import GPT, gpt_loss
    from ..parallel.data import data_parallel
    from ..optim.factory import build_optimizer_for
    from ..parallel.shard import parallelize_shard
    from ..parallel.zero import ZeroDataParallel
    from ..plan import Plan
    from ..train.config import ParallelOptions
    from ..observe.memory_meters import state_bytes

    mesh = init(Plan(shard=world))
    try:
        cfg = _model_config(size)
        gen = torch.Generator().manual_seed(100 + mesh.rank)
        batches = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen)
                   .to(mesh.device) for _ in range(4)]

        def fresh():
            torch.manual_seed(0)
            return GPT(cfg).to(mesh.device)

        def plain_fsdp2():
            model = fresh()
            for block in model.blocks:
                fully_shard(block, mesh=mesh.device_mesh["shard"])
            return fully_shard(model, mesh=mesh.device_mesh["shard"])

        models = {"stage0": data_parallel(fresh(), mesh.axis("shard"), device=mesh.device),
                  "stage1": ZeroDataParallel(fresh(), mesh, 1),
                  "stage2": ZeroDataParallel(fresh(), mesh, 2),
                  "stage3": parallelize_shard(fresh(), mesh, ParallelOptions(zero_stage=3)),
                  "fsdp2": plain_fsdp2()}
        optims = {k: build_optimizer_for(m, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
                  for k, m in models.items()}
        times = {k: [] for k in models}
        memory = {}
        comm = {k: 0 for k in models}

        def step(name: str, i: int, measure: bool = False) -> float:
            tokens = batches[i % len(batches)]
            x, y = tokens[:, :-1], tokens[:, 1:]
            mark = mesh.ledger.snapshot()
            t0 = time.perf_counter()
            loss = gpt_loss(models[name](x), y)
            loss.backward()
            optims[name].step()
            if measure:
                memory[name] = state_bytes(models[name], optims[name])["total"]
            optims[name].zero_grad(set_to_none=True)
            if mesh.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            comm[name] = mesh.ledger.since(mark).total_bytes()
            return dt

        for name in models:
            for i in range(warmup):
                step(name, i, measure=i == warmup - 1)
        names = list(models)
        for rnd in range(steps):  # one step of each variant per round, in a rotating order
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                mesh.barrier()
                times[name].append(step(name, rnd))
        numel = sum(p.numel() for p in models["stage0"].parameters())
        return {"numel": numel, "memory": memory, "comm": comm,
                "step_s": {k: statistics.median(v) for k, v in times.items()},
                "timed_steps": steps}
    finally:
        mesh.close()


def run(args) -> dict:
    from ..launch import spawn
    from ..observe.memory_meters import zero_state_formula

    steps = args.steps or 12
    warmup = max(1, args.warmup)
    batch = 2
    worlds = [int(w) for w in str(getattr(args, "worlds", "2,4")).split(",") if w]
    cfg = _model_config(args.size)
    cores = os.cpu_count() or 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"model": f"GPT {cfg.n_layer}x{cfg.n_embd}, vocab {cfg.vocab_size}, "
                             f"seq {cfg.block_size}", "optimizer": "AdamW fp32",
                    "batch_per_rank": batch, "device": device}
    for world in worlds:
        per_rank = spawn(_rank_main, world, args=(world, args.size, steps, warmup, batch))
        numel = per_rank[0]["numel"]
        result["params"] = numel
        result[f"w{world}_timed_steps"] = per_rank[0]["timed_steps"]
        result[f"w{world}_oversubscribed"] = device == "cpu" and world > cores
        baseline = max(r["step_s"]["fsdp2"] for r in per_rank)
        result[f"w{world}_fsdp2_state_bytes_per_rank"] = max(r["memory"]["fsdp2"] for r in per_rank)
        for stage in range(4):
            name = f"stage{stage}"
            measured = max(r["memory"][name] for r in per_rank)
            formula = zero_state_formula(stage, numel, world)
            step_s = max(r["step_s"][name] for r in per_rank)
            key = f"w{world}_{name}"
            result.update({f"{key}_state_bytes_per_rank": measured,
                           f"{key}_state_bytes_formula": formula,
                           f"{key}_state_ratio": measured / formula,
                           f"{key}_step_s": step_s,
                           f"{key}_step_s_fsdp2_baseline": baseline,
                           f"{key}_step_ratio_vs_fsdp2": step_s / baseline,
                           f"{key}_comm_bytes_per_step": per_rank[0]["comm"][name]})
    return result
