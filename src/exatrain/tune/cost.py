"""The cost model: memory per rank and step time of one Plan for one model on one system.

Memory per rank (bytes), for Ψ parameters held by the rank (after the tensor and pipe splits):

  model state      `observe.memory_meters.zero_state_formula(stage, Ψ, shard)`: 16Ψ unsharded
                   (fp32 AdamW: 4 parameters + 4 gradients + 8 moments), ZeRO 1/2/3 as in `parallel.shard`;
                   ZeRO-3's chunks padded to whole rows per rank, as FSDP2 pads them
  activations      `ModelSpec.act_bytes_per_sample` × samples per micro-batch, divided over the
                   space ranks; under 1D tensor parallelism the split share (Korthikanti et al.
                   2022, Table 2) divided by the tensor degree; under full checkpointing only
                   block inputs plus one block's internals; a pipeline stage holds 1/p of the
                   layers for min(m, p - s) micro-batches in flight (1F1B, stage s) or m (GPipe)
  under pipe       each stage's rank separately (its own parameters and in-flight
                   micro-batches: `Prediction.memory_by_stage`); the Plan's figure is the largest;
                   with shard the stage's state is sharded over shard (ZeRO within a stage), with
                   space the stage's activations are split over space
  published runs   `Options.sequence_parallel` (whole blocks split over tensor), `attention=
                   "materialised"` (softmax and dropout kept, Megatron 2022), `vocab_parallel`
                   and `fp32_grads` describe runs whose layers differ from exatrain's
  transient        backward's gradients of the largest saved activation and of its input, less
                   the activations saved after it (freed by the time backward reaches it)
  the loss         what the loss saves stays fp32 under bf16 / fp16 (the step casts the output
                   up before the loss), and so do the gradients of its largest tensor
  comm buffers     one gradient bucket copy (tensor's GradSync), two gathered blocks (ZeRO-3,
                   prefetch); DDP, ZeRO-1 and ZeRO-2 need none beyond the gradients
  ZeRO-3 peak      the peak is at the end of forward, when no gradient exists yet (gradients
                   are set to None after each step; FSDP2 creates a unit's sharded gradient in
                   its backward, as that unit's activations are freed): state without the
                   4Ψ/N gradients, + activations + the gathered blocks

Step time (seconds):

  compute          training FLOPs of the rank's share of the batch / achievable rate (the system's
                   peak × efficiency for matmul or conv), × 4/3 under full checkpointing
  memory traffic   a user's model: the bytes its memory-bound operators move for the rank's share
                   of the batch (`ModelSpec.traffic_bytes_per_sample`), and once a step whatever
                   the batch (`traffic_bytes_per_step`: every rank's, whole) / the rate eager
                   elementwise operators move them (the system's `elementwise_bandwidth`, per
                   core on a CPU, measured by `exatrain plan --calibrate`; else its memory
                   bandwidth)
  communication    every collective of the strategies' byte formulas (`traffic.comms`, in
                   the ledger's convention) on the link its axis lands on (`systems.System.link`,
                   from the mesh order and ranks per node), ring costs (`systems.collective_time`);
                   under pipe, of the stage that communicates longest (its own gradients, its
                   cuts' activations from `parallel.pipe.split.live_across`, the halos of its
                   own convolution and pooling layers)
  overlap          the gradient all-reduce (data, ZeRO-1/2 buckets) overlaps backward (2/3 of the
                   compute); ZeRO-3's gathers are prefetched under compute; tensor, halo and
                   pipe messages are on the critical path
  pipeline bubble  the schedule's idle fraction, `parallel.pipe.bubble_formula`: (p-1)/(m+p-1)
                   for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3v·m+p-1) zero-bubble
  optimizer        reading and writing the rank's optimizer state once (memory bandwidth)
  fixed costs      per operator, per collective call and per FSDP2 unit
                   (`tune.overheads`: counts from the model and the Plan × the system's
                   calibrated seconds per call); parts_s has one entry per term

The byte formulas are the strategies' own (imported, not rewritten): `zero_state_formula`,
`parallel.tensor.linear1d.{shared_input,column,row}_bytes`, `parallel.spatial.volume`'s halo
volume, `parallel.pipe`'s stage balance and bubble formula. A Plan's bytes agree with the ledger's
counts exactly for data, ZeRO 1/2/3, space, 1D tensor and pipe (`tests/test_planner_measured.py`),
and for 3D tensor and 1D tensor × shard (the dry runs of `tests/test_planner.py`). 3D tensor uses
`Linear3D.bytes_per_step` itself (`traffic._linear3d_bytes`), summed over the layers as
`TensorParallel.bytes_per_step` does. CosmoFlow under 1D tensor (channel/filter convolutions,
column Linears in its head, alone or with data and shard) uses `tune.chanfilt.cnn_tensor` on the
meta model, and equals its dry runs' ledgers too. Compositions whose bytes no test has checked
against a ledger (pipe × tensor, pipe × shard, pipe × space) are costed from the same parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..plan import Plan
from ..observe.memory_meters import zero_state_formula
from . import overheads
from .layout import (PRECISION_BYTES, Options, microbatches, samples_per_rank, stage_params,
                     stages_per_rank)
from .systems import System, collective_time
from .spec import ModelSpec
from .traffic import comms, halo_blocks, transition_bytes

# fp8 runs are rated at bf16's rate: the share of a step that float8 Linears speed up is not
# modelled yet, so the planner's fp8 step time is an upper bound
PRECISION_RATE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "tf32": "tf32", "fp8": "bf16"}


@dataclass
class Prediction:
    plan: Plan
    options: Options
    memory: dict               # params, grads, optimizer, activations, buffers, total
    step_s: float
    parts_s: dict              # compute, comm_exposed, bubble, optimizer
    comms: list = field(default_factory=list)
    memory_by_stage: list = field(default_factory=list)   # per pipeline stage's rank
    calls: dict = field(default_factory=dict)   # counts of the fixed-cost terms (`overheads`)

    @property
    def bytes_by_axis(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.comms:
            if c.nbytes:
                out[c.axis] = out.get(c.axis, 0) + int(c.nbytes)
        return out

    def to_dict(self) -> dict:
        return {"plan": str(self.plan), "degrees": self.plan.to_dict(), "options":
                self.options.label(), "step_s": self.step_s, "memory_per_rank": self.memory,
                "time_parts_s": self.parts_s, "bytes_by_axis": self.bytes_by_axis}


# ----------------------------------------------------------------------------------- the model
def activation_bytes(spec: ModelSpec, plan: Plan, options: Options, stage: int = 0) -> float:
    """Bytes of activations alive at the peak of one step on the rank of pipeline `stage`."""
    m = microbatches(plan, options)
    mb = samples_per_rank(plan, options) / m
    scale = PRECISION_BYTES[options.precision] / 4
    act = spec.act_bytes_per_sample
    if options.checkpointing == "full":
        non_block = max(0.0, act - spec.blocks * spec.block_act_bytes)
        act = min(act, non_block + spec.blocks * spec.block_input_bytes + spec.block_act_bytes)
    t = plan.tensor_degree
    sp = options.sequence_parallel and t > 1 and not plan.tensor_3d
    if options.attention == "materialised" and spec.family == "gpt" and \
            options.checkpointing != "selective":   # selective recomputes exactly these
        # per sample and layer (2s + 1)·a·T² bytes: softmax and dropout output in the compute
        # dtype, the mask in one byte; heads split over tensor; full checkpointing keeps only
        # the recomputed block's; in fp32 units like `act` (scaled below)
        s = PRECISION_BYTES[options.precision]
        core = (2 * s + 1) * spec.heads * spec.tokens ** 2 / t / (s / 4)
        act += core * (1 if options.checkpointing == "full" else spec.blocks)
    if t > 1:
        # the split share applies inside the blocks; embeddings, logits and loss stay whole;
        # under sequence parallelism all of a block's activations split, its input too
        f = 1.0 if sp else spec.tensor_split_fraction
        in_blocks = min(act, spec.blocks * spec.block_act_bytes)
        if options.checkpointing == "full":
            in_blocks = spec.block_act_bytes + (spec.blocks * spec.block_input_bytes if sp
                                                else 0.0)
        act -= in_blocks * f * (1 - 1 / t)
        if plan.tensor_3d:
            act /= plan.tensor[2]
    act /= plan.space_degree
    in_flight = 1
    if plan.pipe > 1:
        # GPipe keeps every micro-batch; 1F1B's stage s warms up with p - s of them
        in_flight = m if options.schedule == "gpipe" else min(m, plan.pipe - stage)
        act = act / plan.pipe * in_flight
    # the loss's tensors are fp32 under every precision (the step casts the output up first):
    # what `scale` took from them, on the stage that computes the loss; the loss stays whole
    # under tensor (its logits are gathered), split only over space
    upcast = 0.0
    if stage == plan.pipe - 1:
        upcast = spec.loss_act_bytes * (1 - scale) * in_flight / plan.space_degree
    return act * scale * mb + upcast * mb


def _memory(spec: ModelSpec, plan: Plan, options: Options, shapes: list, stage_index: int) -> dict:
    """Memory of the rank holding `shapes` (pipeline stage `stage_index`), see the module doc."""
    psi = sum(math.prod(s) for s in shapes)
    stage = options.zero_stage if plan.shard > 1 else 0
    mixed = options.precision != "fp32"
    optim_per_param = {"adamw": 8, "adam": 8, "sgd": 4}.get(options.optimizer, 8)
    if plan.shard > 1 and stage == 3:
        n = plan.shard
        psi_state = sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in shapes)
    else:
        psi_state = psi
    state = zero_state_formula(stage, psi_state, plan.shard, mixed)
    if optim_per_param != 8:   # the formula is AdamW's; other optimizers keep less state
        state -= (8 - optim_per_param) * psi_state / (plan.shard if stage else 1)
    if options.fp32_grads and mixed and stage < 2:   # unsharded gradients, 4 bytes not 2
        state += 2 * psi_state
    if options.optimizer in ("adamw", "adam"):
        state += 4 * len(shapes)   # Adam's step counter: one fp32 scalar per parameter tensor
    acts = activation_bytes(spec, plan, options, stage_index)
    biggest_block = max(psi / max(spec.blocks, 1), 1)
    zero3 = plan.shard > 1 and stage == 3
    if zero3:
        buffers = 2 * biggest_block * 4
    elif plan.tensor_degree > 1 and plan.data > 1:
        # GradSync's flat bucket: one bucket's copy at a time
        buffers = min(psi * 4, options.bucket_cap_mb * 2 ** 20)
    else:
        # DDP and ZeRO-1 reduce the gradients in place (gradient_as_bucket_view); ZeRO-2's send
        # buffer replaces the full gradients it frees
        buffers = 0.0
    # backward holds the gradient of the largest activation and of its input at once; in fp32
    # where the largest is the loss's (GPT's log-softmax over the vocabulary)
    largest_scale = 1.0 if spec.largest_in_loss else PRECISION_BYTES[options.precision] / 4
    transient = 2 * spec.largest_act_bytes * largest_scale \
        * samples_per_rank(plan, options) / microbatches(plan, options) / plan.space_degree
    # ... by then backward has freed what was saved after the largest (a CNN's first layer is its
    # largest: the deeper layers' activations are gone when its gradients exist)
    if spec.act_bytes_per_sample and spec.after_largest_bytes and plan.pipe == 1:
        transient = max(0.0, transient - acts * spec.after_largest_bytes
                        / spec.act_bytes_per_sample)
    if plan.space_degree > 1 and plan.pipe == 1:
        # under space (measured on a 3D U-Net, space=(1, 1, 2): 31.1 MB, serial terms 25.6 MB):
        # each halo convolution saves its halo-extended block; in its backward the gradient of
        # that extended block and the block's own (its interior + the returned halos) are alive
        # at once, one more largest-input-sized tensor than serial; and the tensor the split
        # region ends with (whole samples: the output) and its gradient are whole on every rank
        mb = samples_per_rank(plan, options) / microbatches(plan, options)
        scale = PRECISION_BYTES[options.precision] / 4
        halos, largest_ext = halo_blocks(spec, plan.space)
        acts += halos * mb * scale
        gathered = transition_bytes(spec, plan.space)
        transient += (largest_ext + 2 * gathered * (1 - 1 / plan.space_degree)) * mb * scale
    total = state + acts + buffers + transient
    if zero3:   # forward's end: no gradient yet; backward frees activations as gradients come
        grads = (2 if mixed else 4) * psi_state / plan.shard
        total = max(state - grads + acts + buffers, state + buffers + transient)
    return {"state": state, "activations": acts, "buffers": buffers, "transient": transient,
            "total": total}


def predict(spec: ModelSpec, plan: Plan, system: System, options: Options,
            world: int | None = None) -> Prediction:
    """Memory per rank and step time of `plan` (see the module doc)."""
    stages = stage_params(spec, plan, options.vocab_parallel)
    busiest = max(range(len(stages)), key=lambda k: sum(math.prod(s) for s in stages[k]))
    shapes = stages[busiest]
    psi = sum(math.prod(s) for s in shapes)
    by_stage = [_memory(spec, plan, options, ss, k) for k, ss in enumerate(stages)]
    memory = max(by_stage, key=lambda mem: mem["total"])
    comm_list = comms(spec, plan, options, psi, shapes, busiest)
    if plan.pipe > 1:
        # the stage that communicates longest sets the pace: an end stage sends one way, a
        # middle one both; candidates: the ends, their neighbours and the largest stage
        def seconds(cs):
            return sum(collective_time(c.op, c.nbytes / max(c.calls, 1), c.size,
                                       system.link(c.span)) * c.calls for c in cs)
        for k in sorted({0, 1, plan.pipe - 2, plan.pipe - 1} - {busiest}):
            ss = stages[k]
            other = comms(spec, plan, options, sum(math.prod(s) for s in ss), ss, k)
            if seconds(other) > seconds(comm_list):
                comm_list = other

    rate = system.rate(options.compute_dtype or PRECISION_RATE[options.precision],
                       spec.compute_kind)
    world = world or plan.world_size
    rate *= cores_per_rank(system, world)
    flops = spec.flops_per_sample * options.batch / world
    if options.checkpointing == "full":
        flops *= 4 / 3
    elif options.checkpointing == "selective" and spec.family == "gpt":
        # Korthikanti et al.: recompute only attention's softmax block, QKᵀ and ·V forward
        flops += 4 * spec.blocks * spec.tokens * spec.extra["n_embd"] * spec.tokens \
            * options.batch / world
    compute = flops / rate
    traffic = (spec.traffic_bytes_per_sample * options.batch / world
               + spec.traffic_bytes_per_step) / rank_elementwise_bandwidth(system, world)
    backward = (compute + traffic) * 2 / 3   # what a gradient reduction can hide behind
    exposed = 0.0
    hidden_pool = {"backward": backward, "compute": compute}
    for c in comm_list:
        link = system.link(c.span)
        t = collective_time(c.op, c.nbytes / max(c.calls, 1), c.size, link) * c.calls
        if c.overlap:
            hide = min(t * (1 - 1 / max(c.calls, 1)), hidden_pool[c.overlap])
            hidden_pool[c.overlap] -= hide
            t -= hide
        exposed += t
    m = microbatches(plan, options)
    bubble = 0.0
    if plan.pipe > 1:   # the schedule's own formula (`parallel.pipe.bubble_formula`)
        from ..parallel.pipe import bubble_formula
        idle = bubble_formula(options.schedule, plan.pipe, m, stages_per_rank(options))
        bubble = compute * idle / (1 - idle)
    mem_bw = system.memory_bandwidth or system.measured.get("memory_bandwidth", 0) or 1e12
    optimizer = 3 * memory["state"] / mem_bw
    calls = overheads.counts(spec, plan, options, comm_list, len(shapes), m)
    fixed = overheads.seconds(calls, system)
    step = compute + traffic + exposed + bubble + optimizer + sum(fixed.values())
    return Prediction(plan, options, memory, step,
                      {"compute": compute, "memory_traffic": traffic, "comm_exposed": exposed,
                       "bubble": bubble, "optimizer": optimizer, **fixed}, comm_list, by_stage,
                      calls)


def cores_per_rank(system: System, world: int) -> float:
    """A CPU system's rates are per core: each local rank gets cores // ranks threads, and ranks
    beyond the cores share them. 1 on a device (no `measured.cores`)."""
    cores = (system.measured or {}).get("cores")
    if not cores:
        return 1.0
    local = min(world, system.ranks_per_node)
    return max(1, cores // local) * min(1.0, cores / local)


def rank_elementwise_bandwidth(system: System, world: int) -> float:
    """Bytes per second one rank's memory-bound operators move: on a CPU system the measured
    rate of one core (`measured.elementwise_bandwidth`, else its memory bandwidth) times the
    rank's cores; on a GPU the device's memory bandwidth."""
    measured = system.measured or {}
    per_core = measured.get("elementwise_bandwidth") or measured.get("memory_bandwidth")
    if measured.get("cores") and per_core:
        return per_core * cores_per_rank(system, world)
    return system.memory_bandwidth or per_core or 1e12
