"""Dry run: one rank of an N-rank job, in this process, over torch's fake process group.

`dry_run(config, plan, rank)` initialises torch.distributed with the "fake" backend
(`torch.testing._internal.distributed.fake_pg.FakeStore`; torchtitan's COMM_MODE=fake_backend):
every collective returns at once without moving data, so rank R of a 1024-rank job runs alone.
It then does what the Trainer does on that rank — builds the model (on the meta device where the
strategy can split it there), `parallelize`s it over a real `Mesh` of the Plan, feeds it this
rank's part of one batch (its samples; under `space` its block of each sample), runs forward,
loss and backward, and an optimizer step — and reports:

  param_shapes        name -> shape of every parameter as this rank holds it (a sharded
                      DTensor's local shard)
  state_bytes         `observe.memory_meters.state_bytes` after the optimizer step (params,
                      grads, optimizer)
  step_peak_bytes     `observe.memory_meters.StepPeak` of forward + backward (activations, new
                      gradients)
  ledger_bytes        bytes per mesh axis the rank's collectives carried (the ledger still counts
                      what the fake group did not move)
  ledger_entries      [axis, op, tag, calls, bytes] of every (axis, op, tag) the step recorded
  coords              the rank's coordinates on the mesh

What runs on meta: tensor parallelism splits a meta model before allocating (each rank allocates
only its parts), so a 1024-rank tensor Plan materialises 1/t of the weights. Data, shard and
space strategies start from a materialised model (`parallel.apply` moves it to the device first),
so for them the whole model is allocated once on this process before being split: the dry run
says so and refuses models whose full size exceeds `max_full_bytes`.
Values computed on fake collectives are garbage (the received buffers are never filled); the
shapes, the bytes and the memory are what a real rank would see.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..plan import Plan, PlanError
from ..errors import ArgumentError, ConfigError


def _fake_group(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; the dry run "
                           "needs its own (run it in a fresh process)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def fake_mesh(plan: Plan, rank: int):
    """A live `Mesh` for `plan` in which this process is `rank`, over the fake backend."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..mesh import Mesh
    _fake_group(rank, plan.world_size)
    device_mesh = init_device_mesh("cpu", tuple(plan.degrees().values()),
                                   mesh_dim_names=tuple(plan.degrees()))
    return Mesh(plan, torch.device("cpu"), "fake", device_mesh, local_rank=0)


def _build(config, on_meta: bool):
    workload = config.run.workload
    if workload == "gpt":
        from ..models.gpt import GPT, gpt_loss
        from ..workloads.gpt import model_config
        cfg = model_config(config.model)
        with torch.device("meta" if on_meta else "cpu"):
            model = GPT(cfg)
        return model, cfg, gpt_loss
    if workload == "cosmoflow":
        from ..models.cosmoflow import CosmoFlow
        m = config.model
        with torch.device("meta" if on_meta else "cpu"):
            model = CosmoFlow(size=m.size, base_channels=m.base_channels,
                              conv_layers=m.conv_layers, batchnorm=m.batchnorm)
        return model, m, torch.nn.functional.mse_loss
    if workload == "vit":   # the shallow-water fields h, u, v: 3 channels
        from ..models.vit import ViTForecaster, relative_l2_loss
        m, d = config.model, config.data
        with torch.device("meta" if on_meta else "cpu"):
            model = ViTForecaster(img_size=(d.height, d.width), patch_size=m.patch_size,
                                  in_channels=3, out_channels=3, embed_dim=m.embed_dim,
                                  depth=m.depth, num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
                                  dropout=m.dropout, residual=m.residual)
        return model, d, relative_l2_loss
    raise ConfigError(f"run.workload={workload!r}: the dry run knows gpt, cosmoflow and vit")


def dry_run(config, plan: Plan, rank: int, max_full_bytes: float = 4 * 2 ** 30) -> dict:
    """Run one step of rank `rank` of `plan` in this process (see the module doc)."""
    from ..comm.dtensor import local_tensor
    from ..optim.factory import build_optimizer
    from ..parallel import parallelize
    from ..parallel.options import ParallelOptions
    from ..observe.memory_meters import StepPeak, state_bytes

    plan.require_implemented()
    world = plan.world_size
    if not 0 <= rank < world:
        raise ArgumentError(f"--dry-run {rank}: ranks of {plan} are 0..{world - 1}")
    p = config.parallel
    options = ParallelOptions(zero_stage=p.zero_stage, precision=p.precision,
                              activation_checkpointing=p.activation_checkpointing,
                              batchnorm=p.batchnorm, chanfilt_from=p.chanfilt_from,
                              chanfilt_skip=list(p.chanfilt_skip))
    splits_on_meta = plan.tensor_degree > 1
    notes = []
    model, shape, loss_fn = _build(config, on_meta=True)
    full = sum(t.numel() * t.element_size() for t in model.parameters())
    if not splits_on_meta:
        if full > max_full_bytes:
            raise PlanError(
                f"{plan}: the data/shard/space strategies split a materialised model "
                f"(parallel.apply moves it to the device first), so this dry run would allocate "
                f"the whole model ({full / 2 ** 30:.1f} GiB) in this process; limit "
                f"{max_full_bytes / 2 ** 30:.1f} GiB. Tensor Plans split on the meta device.")
        model = model.to_empty(device="cpu")
        notes.append("model materialised whole before splitting (data/shard/space start from "
                     "a materialised model)")
    mesh = fake_mesh(plan, rank)
    try:
        replicas = plan.data * plan.shard
        batch = config.train.batch_size
        if batch % replicas:
            raise ConfigError(f"train.batch_size={batch} does not split over data×shard="
                              f"{replicas}; use a multiple of {replicas}")
        per_rank = batch // replicas // config.train.grad_accum
        net = parallelize(model, mesh, options, example=_switch_example(config, shape, plan))
        if plan.tensor_degree > 1 and any(t.is_meta for t in net.parameters()):
            notes.append("parameters left on meta")
        x, y = _inputs(config, shape, mesh, per_rank)
        # the run's optimizer (its state is what the rank holds), over every parameter: a fake
        # mesh runs no ZeRO all-gather after the step, and K-FAC's state is not modelled
        optim = build_optimizer(net.parameters(), config.optim, 0.0)
        peak = StepPeak(mesh.device)
        mesh.ledger.reset()
        with peak.track():
            out = net(x)
            loss_fn(out, y).backward()
        ledger = mesh.ledger.bytes_by_axis()
        entries = [[axis, op, tag, e.calls, e.bytes]
                   for (axis, op, tag), e in sorted(mesh.ledger.entries.items())]
        optim.step()
        state = state_bytes(net, optim)
        # what this rank holds: a DTensor's (FSDP2's) local shard, not its logical shape
        shapes = {name: list(local_tensor(t).shape)
                  for name, t in net.named_parameters()}
        return {"plan": str(plan), "rank": rank, "world": world, "coords": mesh.coords,
                "samples_per_rank": per_rank, "input_shape": list(x.shape),
                "param_shapes": shapes, "params_local": sum(math.prod(s) for s in shapes.values()),
                "params_full": sum(t.numel() for t in model.parameters()) if not splits_on_meta
                else None, "state_bytes": state, "step_peak_bytes": peak.bytes,
                "ledger_bytes": ledger, "ledger_entries": entries, "notes": notes}
    finally:
        mesh.close()


def _switch_example(config, shape, plan: Plan):
    """Under space × tensor, the whole samples of one replica's batch on the meta device: the
    shapes from which the channel/filter switch point is placed (as `train.job.pipeline_example`
    gives the Trainer); None otherwise."""
    if plan.pipe > 1 or plan.space_degree == 1 or plan.tensor_degree == 1 or plan.tensor_3d:
        return None
    with torch.device("meta"):          # shapes only: nothing is allocated
        x, _y = _inputs(config, shape, None, config.train.batch_size // (plan.data * plan.shard))
    return x


def _inputs(config, shape, mesh, per_rank: int):
    if config.run.workload == "gpt":
        idx = torch.zeros(per_rank, shape.block_size, dtype=torch.long)
        return idx, idx
    if config.run.workload == "vit":
        x = torch.zeros(per_rank, 3, shape.height, shape.width)
        return x, x.clone()
    size = shape.size
    x = torch.zeros(per_rank, 4, size, size, size)
    if mesh is not None and mesh.plan.space_degree > 1:
        from ..parallel.spatial import block_region
        region = block_region((size,) * 3, mesh)
        x = x[(slice(None), slice(None)) + region].contiguous()
    return x, torch.zeros(per_rank, 4)
