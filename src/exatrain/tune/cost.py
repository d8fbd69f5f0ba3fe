"""The cost model: memory per rank and step time of one Plan for one model on one system.

Memory per rank (bytes), for Ψ parameters held by the rank (after the tensor and pipe splits):

  model state      `train.memory.zero_state_formula(stage, Ψ, shard)`: 16Ψ unsharded (fp32 AdamW:
                   4 parameters + 4 gradients + 8 moments), ZeRO 1/2/3 as in `parallel.shard`;
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
  comm buffers     one gradient bucket copy (tensor's GradSync), two gathered blocks (ZeRO-3,
                   prefetch); DDP, ZeRO-1 and ZeRO-2 need none beyond the gradients
  ZeRO-3 peak      the peak is at the end of forward, when no gradient exists yet (gradients
                   are set to None after each step; FSDP2 creates a unit's sharded gradient in
                   its backward, as that unit's activations are freed): state without the
                   4Ψ/N gradients, + activations + the gathered blocks

Step time (seconds):

  compute          training FLOPs of the rank's share of the batch / achievable rate (the system's
                   peak × efficiency for matmul or conv), × 4/3 under full checkpointing
  communication    every collective of the strategies' byte formulas (`bytes_by_axis` below, in
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
`Linear3D.bytes_per_step` itself (`_linear3d_bytes`), summed over the layers as
`TensorParallel.bytes_per_step` does. CosmoFlow under 1D tensor (channel/filter convolutions,
column Linears in its head, alone or with data and shard) uses `tune.chanfilt.cnn_tensor` on the
meta model, and equals its dry runs' ledgers too. Compositions whose bytes no test has checked
against a ledger (pipe × tensor, pipe × shard, pipe × space) are costed from the same parts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..plan import Plan
from ..observe.memory_meters import zero_state_formula
from . import overheads
from .spec import ModelSpec
from .systems import System, collective_time

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp8 runs are rated at bf16's rate: the share of a step that float8 Linears speed up is not
# modelled yet, so the planner's fp8 step time is an upper bound
PRECISION_RATE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "tf32": "tf32", "fp8": "bf16"}


@dataclass(frozen=True)
class Options:
    """How a Plan is run beyond its degrees (the config's [parallel] and [train] that matter)."""
    batch: int = 8                     # global batch per optimizer step
    precision: str = "fp32"
    zero_stage: int = 3                # with shard > 1
    checkpointing: str = "none"        # none | full | selective (memory as none here)
    microbatches: int = 0              # with pipe > 1 (0: two per stage, as parallel.pipe)
    schedule: str = "1f1b"             # gpipe | 1f1b | interleaved | zero_bubble
    virtual_stages: int = 2            # stages per rank of interleaved / zero_bubble
    optimizer: str = "adamw"           # adamw | adam | sgd
    bucket_cap_mb: float = 25.0
    compute_dtype: str = ""            # overrides the rate's dtype (e.g. tf32 for fp32 on GPUs)
    # 1D tensor: sequence parallelism (parallel.sequence_parallel) splits the whole of every
    # block's activations over tensor, the layer norms' too (Korthikanti et al. 2022, Table 2)
    sequence_parallel: bool = False
    # how the runs being predicted differ from exatrain's own layers, for published runs:
    # "materialised" attention keeps softmax, dropout mask and dropout output (5·a·s² bytes per
    # sample and layer in fp16, Megatron 2022) where SDPA's fused kernels keep none;
    # vocab_parallel splits the token embedding over tensor (Megatron) where exatrain's 1D
    # tensor parallelism keeps it whole
    attention: str = "fused"           # fused | materialised
    vocab_parallel: bool = False
    # Megatron's fp32 gradient buffer (main_grad) beside fp16 parameters: 2 + 4 + 12 bytes per
    # parameter where the ZeRO paper's mixed-precision count (zero_state_formula) has 2 + 2 + 12
    fp32_grads: bool = False
    batchnorm: str = "global"          # parallel.batchnorm: global | replica

    def label(self) -> str:
        parts = []
        if self.zero_stage != 3:
            parts.append(f"zero{self.zero_stage}")
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        if self.microbatches:
            parts.append(f"m={self.microbatches}")
        if self.schedule != "1f1b":
            parts.append(self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1
                                          else ""))
        return " ".join(parts)


def options_from_config(config) -> Options:
    """The Options of a run's config ([train] batch, [parallel], [optim] name)."""
    p = config.parallel
    return Options(batch=config.train.batch_size, precision=p.precision,
                   zero_stage=p.zero_stage,
                   checkpointing="full" if p.activation_checkpointing != "none" else "none",
                   microbatches=int(getattr(p, "microbatches", 0) or 0),
                   schedule=str(getattr(p, "pipe_schedule", "1f1b") or "1f1b").lower(),
                   virtual_stages=int(getattr(p, "pipe_virtual_stages", 2) or 2),
                   optimizer=config.optim.name, bucket_cap_mb=p.bucket_cap_mb,
                   batchnorm=p.batchnorm)


@dataclass
class Comm:
    axis: str          # the ledger's axis name ("data", "data+space", "tensor", ...)
    op: str
    nbytes: float      # per step, ledger convention
    calls: int
    size: int          # ranks in the group
    span: int          # first to one past last rank of the group (row-major mesh)
    overlap: str = ""  # "backward" | "compute" | ""


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


# ------------------------------------------------------------------------------- shapes of Plans
def strides(plan: Plan) -> dict[str, int]:
    """Rank distance between neighbours of every mesh dimension (row-major, innermost last)."""
    out, step = {}, 1
    for name, degree in reversed(list(plan.degrees().items())):
        out[name] = step
        step *= degree
    return out


def group(plan: Plan, *axes: str) -> tuple[str, int, int]:
    """(ledger name, size, span) of the group over the named top-level axes: span is the distance
    from its first to one past its last rank, which decides whether it stays on one node."""
    dims = plan.degrees()
    st = strides(plan)
    used = [d for d in dims if (d in axes or d.split("_")[0] in axes) and dims[d] > 1]
    size = math.prod(dims[d] for d in used)
    outer = max(used, key=lambda d: st[d], default=None)
    span = st[outer] * dims[outer] if outer else 1
    return "+".join(axes), size, span


def samples_per_rank(plan: Plan, options: Options) -> float:
    """Samples one rank's replica processes per step (data and shard split the batch)."""
    return options.batch / (plan.data * plan.shard)


# ----------------------------------------------------------------------------------- parameters
def stage_params(spec: ModelSpec, plan: Plan, vocab_parallel: bool = False) -> list[list]:
    """The parameter shapes each pipeline stage's rank holds after the tensor split (one list
    without pipe)."""
    shapes = list(spec.param_shapes)
    t = plan.tensor_degree
    if t > 1 and spec.family == "cosmoflow" and not plan.tensor_3d:
        shapes = list(_cnn_tensor(spec, t, 4)[2])   # channel/filter and Linear splits
    elif t > 1 and spec.tensor_dims and plan.tensor_3d:
        shapes = _split_3d(spec, plan, shapes)
    elif t > 1 and spec.tensor_dims:
        def split(s, d):
            if d < 0 or s[d] % t:
                return s
            return tuple(n // t if i == d else n for i, n in enumerate(s))
        dims = list(spec.tensor_dims)
        if vocab_parallel and spec.family == "gpt":
            dims[0] = 0   # the token embedding, split by vocabulary rows
        shapes = [split(s, d) for s, d in zip(shapes, dims)]
    if plan.pipe == 1 or not spec.pipe_layers:
        return [shapes]
    # layers hold consecutive parameters (registration order is execution order here), so a
    # stage is a slice of the (tensor-split) shapes
    bounds = stage_bounds(spec, plan)
    first = [0]
    for layer in spec.pipe_layers:
        first.append(first[-1] + len(layer))
    return [shapes[first[a]:first[b]] for a, b in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=64)
def _cnn_tensor_cached(kwargs: tuple, sample_shape: tuple, t: int, element_size: int) -> tuple:
    from .chanfilt import cnn_tensor, cosmoflow_meta
    model = cosmoflow_meta(**dict(kwargs))
    one = cnn_tensor(model, Plan(tensor=t), sample_shape, 1, element_size)
    per_op = tuple((op, b, c) for op, (b, c) in sorted(one["per_sample_by_op"].items()))
    return (one["per_sample_bytes"], one["calls"], tuple(one["local_shapes"]),
            tuple(one["batchnorm_channels"]), per_op)


def _cnn_tensor(spec: ModelSpec, t: int, element_size: int) -> tuple:
    """(tensor-axis bytes per sample, collectives, local parameter shapes, local BatchNorm
    channels, (op, bytes per sample, calls) per collective) of CosmoFlow under 1D tensor = t:
    `tune.chanfilt.cnn_tensor` on the meta model."""
    e = spec.extra
    kwargs = tuple(sorted((k, e[k]) for k in ("size", "in_channels", "base_channels",
                                               "conv_layers", "batchnorm")))
    return _cnn_tensor_cached(kwargs, (e["in_channels"], *spec.spatial_shape), t, element_size)


def stage_bounds(spec: ModelSpec, plan: Plan) -> list[int]:
    """[0, first layer of stage 1, ..., number of layers]: the stages `parallel.pipe` cuts
    (balanced by parameters, its own `balanced_starts`)."""
    if plan.pipe == 1 or not spec.pipe_layers:
        return [0, len(spec.pipe_layers)]
    from ..parallel.pipe.split import balanced_starts
    costs = tuple(sum(math.prod(s) for s in layer) for layer in spec.pipe_layers)
    key = (costs, plan.pipe)
    if key not in _BOUNDS_CACHE:   # an exact DP over the layers: once per model and degree
        _BOUNDS_CACHE[key] = [0, *balanced_starts(list(costs), plan.pipe), len(costs)]
    return _BOUNDS_CACHE[key]


_BOUNDS_CACHE: dict = {}


def _split_3d(spec: ModelSpec, plan: Plan, shapes: list) -> list:
    """The local shapes under the 3D grid (`parallel.tensor.linear3d.Linear3D`): a plain layer
    (1D's column: q/k/v, fc_in, lm_head) keeps W[out/(X·Z), in/Y] and bias[out/X]; a transposed
    one (1D's row: out_proj, fc_out) W[out/(Y·Z), in/X] and bias[out/Y]; lm_head only when
    out divides X·Z and in divides Y (`convert._fits_single`), else whole."""
    X, Y, Z = plan.tensor
    dims, bias = spec.tensor_dims, spec.extra.get("bias", False)
    out, k = [], 0
    while k < len(shapes):
        s, d = shapes[k], dims[k]
        if d == 0 and len(s) == 2 and s[0] % (X * Z) == 0 and s[1] % Y == 0:
            out.append((s[0] // (X * Z), s[1] // Y))
            if bias and k + 1 < len(shapes) and dims[k + 1] == 0 and len(shapes[k + 1]) == 1:
                out.append((shapes[k + 1][0] // X,))
                k += 1
        elif d == 1 and len(s) == 2:
            out.append((s[0] // (Y * Z), s[1] // X))
            if bias and k + 1 < len(shapes) and len(shapes[k + 1]) == 1:
                out.append((shapes[k + 1][0] // Y,))   # the transposed layer's bias
                k += 1
        else:
            out.append(s)
        k += 1
    return out


def local_params(spec: ModelSpec, plan: Plan, vocab_parallel: bool = False) -> tuple[int, list]:
    """(Ψ held by the busiest rank, its parameter shapes) after the tensor and pipe splits."""
    shapes = max(stage_params(spec, plan, vocab_parallel),
                 key=lambda ss: sum(math.prod(s) for s in ss))
    return sum(math.prod(s) for s in shapes), shapes


# ---------------------------------------------------------------------------- byte formulas
def comms(spec: ModelSpec, plan: Plan, options: Options, psi: int, shapes: list,
          stage: int = 0) -> list[Comm]:
    """Every collective of one training step on a rank of pipeline `stage` holding `shapes`
    (Ψ = `psi`), ledger convention."""
    from ..parallel.tensor.linear1d import column_bytes, row_bytes, shared_input_bytes

    out: list[Comm] = []
    grad = 4  # gradients are reduced in fp32 under every precision policy
    mb = samples_per_rank(plan, options)
    m = _microbatches(plan, options)

    def add(axes, op, nbytes, calls, overlap=""):
        name, size, span = group(plan, *axes)
        if size > 1 and nbytes > 0:
            out.append(Comm(name, op, nbytes, calls, size, span, overlap))

    buckets = max(1, math.ceil(psi * grad / (options.bucket_cap_mb * 2 ** 20)))
    if plan.shard > 1:
        n = plan.shard
        padded = sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in shapes) * grad
        if options.zero_stage == 1:
            add(("data", "shard"), "all_reduce", psi * grad, buckets, "backward")
            add(("shard",), "all_gather", padded, buckets)
        elif options.zero_stage == 2:
            add(("shard",), "reduce_scatter", padded, buckets, "backward")
            add(("data",), "all_reduce", padded / n, buckets, "backward")
            add(("shard",), "all_gather", padded, buckets)
        else:
            units = math.ceil(len(spec.block_ranges) / plan.pipe) + 1   # this stage's blocks
            # every unit, the root too, is gathered in forward and again in backward, in the
            # compute dtype (FSDP2's MixedPrecisionPolicy); gradients reduce in fp32
            gather = padded * PRECISION_BYTES[options.precision] / grad
            add(("shard",), "all_gather", 2 * gather, 2 * units, "compute")
            add(("shard",), "reduce_scatter", padded, units, "backward")
            add(("data",), "all_reduce", padded / n, units, "backward")
    elif plan.space_degree > 1:
        add(("data", "space"), "all_reduce", psi * grad, buckets, "backward")
    elif plan.tensor_degree == 1 or spec.family == "cosmoflow":
        # (a CNN's tensor ranks reduce their local gradients over data, as GradSync does)
        add(("data",), "all_reduce", psi * grad, buckets, "backward")

    if plan.space_degree > 1:
        # this stage's convolution and pooling layers (all of them without pipe): the halo of
        # layers [g0, g1) as a difference of prefixes, so the model's first layer alone skips
        # its input gradient
        g0, g1, last = _stage_geometry(spec, plan, stage)
        halo = (_halo_bytes(spec, plan.space, g1) - _halo_bytes(spec, plan.space, g0)) \
            / plan.space_degree * mb
        # halos move both ways (send and receive are both counted)
        add(("space",), "send", 2 * halo, 2 * (g1 - g0), "")
        at = _transition_index(spec, plan.space)
        if g0 <= at < g1 or (at == len(_geometry(spec)) and last):
            add(("space",), "all_gather", _transition_bytes(spec, plan.space) * mb, 1)

    _batchnorm_comms(spec, plan, options, stage, add)

    t = plan.tensor_degree
    if t > 1 and spec.family == "gpt" and plan.tensor_3d:
        for axes, op, nbytes, calls, overlap in _tensor3d_comms(spec, plan, options, shapes):
            add(axes, op, nbytes, calls, overlap)
    elif t > 1 and spec.family == "cosmoflow":
        # channel/filter convolutions and the head's Linears (`tune.chanfilt.cnn_tensor`):
        # per sample, plus the dropout-seed broadcast once per forward
        # priced per collective: the pairs all-reduce, the gathered layers all-gather
        from .chanfilt import SEED_BYTES
        per_op = _cnn_tensor(spec, t, PRECISION_BYTES[options.precision])[4]
        for op, per_sample, calls in per_op:
            add(("tensor",), op, per_sample * mb, calls)
        add(("tensor",), "broadcast", SEED_BYTES, 1)
    elif t > 1 and spec.family == "gpt":
        s = PRECISION_BYTES[options.precision]
        rows = int(mb * spec.tokens)
        E, V = spec.extra["n_embd"], spec.extra["vocab_size"]
        per_block = 2 * (shared_input_bytes(rows, E, s) + row_bytes(rows, E, E, s, False))
        blocks = math.ceil(spec.blocks / plan.pipe)   # this stage's blocks
        total = blocks * per_block + 8   # + the dropout seed broadcast
        if options.checkpointing == "full":   # recomputing a block repeats its forward g's
            total += blocks * 2 * row_bytes(rows, E, E, s, False)
        if V % t == 0 and plan.pipe == 1:     # lm_head (on the last stage under pipe)
            total += column_bytes(rows, E, V, s, gather_output=True, own_f=True)
        add(("tensor",), "all_reduce", total, 4 * blocks + 2)
        if plan.shard == 1:   # under shard the ZeRO branch above reduces the gradients
            add(("data",), "all_reduce", psi * grad, buckets, "backward")

    if plan.pipe > 1:
        # `parallel.pipe.stage`: 2·A per micro-batch and boundary, counted by the sending rank; a
        # middle stage sends activations forward and gradients backward, an end stage one of the
        # two; a rank of a looped schedule holds v stages
        s = PRECISION_BYTES[options.precision]
        v = _virtual(options)
        directions = 2 if plan.pipe * v > 2 else 1
        if v == 1 and spec.pipe_cut_shapes:
            # what this stage's cuts carry (`live_across`): forward its output, backward the
            # gradient of its input; a spatial block per space rank while the split lasts
            bounds = stage_bounds(spec, plan)
            sent = (_cut_bytes(spec, plan, bounds[stage + 1]) if stage < plan.pipe - 1 else 0.0) \
                + (_cut_bytes(spec, plan, bounds[stage]) if stage > 0 else 0.0)
            calls = (stage < plan.pipe - 1) + (stage > 0)
            add(("pipe",), "send", sent / 4 * s * mb, calls * m)
        else:
            act = spec.boundary_bytes / 4 * s * mb / m
            add(("pipe",), "send", directions * v * act * m, directions * v * m)
    return out



def _batchnorm_comms(spec: ModelSpec, plan: Plan, options: Options, stage: int, add) -> None:
    """`parallel.batchnorm`'s statistics (global mode), per BatchNorm layer of the stage and
    micro-batch: an all-gather of R × (2C + 1) float64 and an all-reduce of 2C float32 (R ranks:
    the replica axes, and `space` where the layer's input is still split into blocks); the
    all-gather runs again when checkpointing recomputes the block. A BatchNorm follows each
    convolution (CosmoFlow's `model.batchnorm`): spec.extra["batchnorm_channels"]."""
    from torch import nn
    channels = spec.extra.get("batchnorm_channels") or []
    if not channels or options.batchnorm != "global":
        return
    if plan.tensor_degree > 1 and not plan.tensor_3d:   # a pair's BatchNorm holds 1/t
        channels = _cnn_tensor(spec, plan.tensor_degree, 4)[3]
    replicas = ("data", "shard") if plan.shard > 1 else ("data",)
    geometry = _geometry(spec)
    convs = [k for k, (layer, _i, _o) in enumerate(geometry) if isinstance(layer, nn.Conv3d)]
    g0, g1, _ = _stage_geometry(spec, plan, stage)
    at = _transition_index(spec, plan.space) if plan.space_degree > 1 else len(geometry)
    micro = _microbatches(plan, options)
    forwards = micro * (2 if options.checkpointing != "none" else 1)
    for c, k in zip(channels, convs):
        if not g0 <= k < g1:
            continue
        axes = replicas + (("space",) if plan.space_degree > 1 and k < at else ())
        size = group(plan, *axes)[1]
        add(axes, "all_gather", size * (2 * c + 1) * 8 * forwards, forwards)
        add(axes, "all_reduce", 2 * c * 4 * micro, micro, "backward")


def _linear3d_bytes(in_f: int, out_f: int, grid: tuple, rows: int, act_s: int,
                    transpose: bool = False, scatter_input: bool = True,
                    gather_output: bool = True, shared: bool = False) -> dict[str, int]:
    """One 3D layer's bytes per forward + backward, by the strategy's own formula:
    `Linear3D.bytes_per_step` (`parallel.tensor.linear3d`) evaluated on a stand-in holding the
    attributes it reads (the layer itself needs a live grid). The weight all-gathers and
    reduce-scatter over z move fp32 master weights (4 bytes), the activations `act_s` bytes."""
    from types import SimpleNamespace as NS

    from ..parallel.tensor.linear3d import Linear3D
    X, Y, Z = grid
    x, y, z = (NS(name=f"tensor_{a}", size=n) for a, n in zip("xyz", (X, Y, Z)))
    in_axis, out_axis = (x, y) if transpose else (y, x)

    def evaluate(s):
        stub = NS(weight=NS(element_size=lambda: s), _rows=rows, grid=NS(z=z), in_axis=in_axis,
                  out_axis=out_axis, local_out=out_f // out_axis.size,
                  local_in=in_f // in_axis.size, _input_grad=True,
                  shared_input=object() if shared else None, scatter_input=scatter_input,
                  in_features=in_f, out_features=out_f, gather_output=gather_output)
        return Linear3D.bytes_per_step(stub)

    got = {k: v for k, v in evaluate(act_s).items() if k != "tensor_z"}
    weights = evaluate(4).get("tensor_z", 0)
    if weights:
        got["tensor_z"] = weights
    return got


def _tensor3d_comms(spec: ModelSpec, plan: Plan, options: Options, shapes: list) -> list:
    """A GPT's collectives under the 3D grid (X, Y, Z), per step, as `parallel.tensor.convert`
    lays it out and `TensorParallel.bytes_per_step` sums them:

      per block   q/k/v plain layers sharing one input scatter over y (`SharedScatter`: backward
                  all-gather n·E·s), out_proj transposed (no input scatter, output gathered
                  over y); fc_in plain with its shared scatter, fc_out transposed
      lm_head     a plain layer on its own (input scattered over y, output gathered over x) when
                  vocab divides X·Z and n_embd divides Y
      boundary    the 8-byte dropout seed broadcast on tensor; with Z > 1 the batch is split over
                  z (zero-padded to a multiple of Z) and the logits all-gathered over z
      gradients   `GradSync`: split weights mean over data; biases of 3D layers and whole
                  parameters (embeddings, norms) also sum over tensor_z, one all-reduce over
                  data+tensor_z; 4 bytes per parameter

    n = rows of this z-shard, ceil(samples / Z) × tokens per forward; a pipe stage (micro-batches
    m) holds its own blocks and repeats every forward/backward m times."""
    from ..parallel.tensor.linear1d import shared_input_bytes
    X, Y, Z = plan.tensor
    s = PRECISION_BYTES[options.precision]
    m = _microbatches(plan, options)
    per_micro = samples_per_rank(plan, options) / m
    rows = math.ceil(per_micro / Z) * spec.tokens
    E, V = spec.extra["n_embd"], spec.extra["vocab_size"]
    H = spec.extra.get("mlp_hidden", 4 * E)
    grid = (X, Y, Z)
    per_axis: dict[str, float] = {}
    calls: dict[str, int] = {}

    def add(parts: dict, n_calls: int = 1, times: int = 1):
        for k, v in parts.items():
            if v:
                per_axis[k] = per_axis.get(k, 0) + v * m * times
                calls[k] = calls.get(k, 0) + n_calls * m * times

    blocks = math.ceil(spec.blocks / plan.pipe)   # every block alike: one, times the count
    add(_linear3d_bytes(E, E, grid, rows, s, gather_output=False, shared=True), 3, 3 * blocks)
    add({"tensor_y": shared_input_bytes(rows, E, s) if Y > 1 else 0}, 1, 2 * blocks)
    add(_linear3d_bytes(E, E, grid, rows, s, transpose=True, scatter_input=False), 4, blocks)
    add(_linear3d_bytes(E, H, grid, rows, s, gather_output=False, shared=True), 3, blocks)
    add(_linear3d_bytes(H, E, grid, rows, s, transpose=True, scatter_input=False), 4, blocks)
    head = not spec.extra.get("tie_weights") and V % (X * Z) == 0 and E % Y == 0
    if head and plan.pipe == 1:
        add(_linear3d_bytes(E, V, grid, rows, s), 5)
    out = [(("tensor_x",), "all_reduce", per_axis.get("tensor_x", 0), calls.get("tensor_x", 1),
            ""),
           (("tensor_y",), "all_reduce", per_axis.get("tensor_y", 0), calls.get("tensor_y", 1),
            ""),
           (("tensor_z",), "all_gather", per_axis.get("tensor_z", 0), calls.get("tensor_z", 1),
            "compute")]
    out.append((("tensor",), "broadcast", 8 * m, m, ""))
    if Z > 1 and plan.pipe == 1:
        # the logits of this z-shard, all-gathered (counted as the gathered size); fp32 logits
        out.append((("tensor_z",), "all_gather", rows * (V if head else V) * 4 * Z, 1, ""))
    # gradients: split weights over data; 3D biases and whole parameters over data+tensor_z
    # (GradSync names the group by its axes of size > 1: "tensor_z" alone when data = 1)
    whole_axes = tuple(a for a, n in (("data", plan.data), ("tensor_z", Z)) if n > 1)
    split_n = sum(math.prod(sh) for sh in shapes if len(sh) == 2) - _whole_2d(spec, plan)
    rest = sum(math.prod(sh) for sh in shapes) - split_n
    out.append((("data",), "all_reduce", 4 * split_n, 1, "backward"))
    if whole_axes:
        out.append((whole_axes, "all_reduce", 4 * rest, 1, "backward"))
    return out


def _whole_2d(spec: ModelSpec, plan: Plan) -> int:
    """Elements of the 2-D parameters the 3D grid leaves whole on every rank of this stage:
    the embeddings (first stage), and lm_head when it does not divide."""
    X, Y, Z = plan.tensor
    if plan.pipe > 1:
        return 0   # not resolved per stage here (pipe × 3D tensor: bytes unchecked)
    E, V = spec.extra["n_embd"], spec.extra["vocab_size"]
    whole = sum(math.prod(sh) for sh, d in zip(spec.param_shapes, spec.tensor_dims)
                if len(sh) == 2 and d < 0)
    if not spec.extra.get("tie_weights") and not (V % (X * Z) == 0 and E % Y == 0):
        whole += V * E
    return whole


def _microbatches(plan: Plan, options: Options) -> int:
    if plan.pipe == 1:
        return 1
    return options.microbatches or 2 * plan.pipe   # parallel.microbatches = 0: two per stage


def _virtual(options: Options) -> int:
    """Stages per rank: the looped schedules hold several."""
    return options.virtual_stages if options.schedule in ("interleaved", "zero_bubble") else 1


_HALO_CACHE: dict = {}


def _geometry(spec: ModelSpec):
    if "geometry" in spec.extra or spec.family == "user":   # a user's model: traced with it
        return spec.extra.get("geometry", [])
    base = spec.extra.get("base_channels", 32)
    key = (spec.name, spec.spatial_shape, base)
    if key not in _HALO_CACHE:
        from ..models.cosmoflow import CosmoFlow
        from ..parallel.spatial.volume import layer_geometry
        c = spec.extra.get("in_channels", 4)
        model = CosmoFlow(size=spec.extra["size"], in_channels=c, base_channels=base) if \
            spec.spatial_shape[0] <= 64 else None
        if model is None:
            import torch
            with torch.device("meta"):
                model = CosmoFlow(size=spec.extra["size"], in_channels=c, base_channels=base)
        _HALO_CACHE[key] = layer_geometry(model, (1, c) + tuple(spec.spatial_shape))
    return _HALO_CACHE[key]


def _halo_bytes(spec: ModelSpec, space: tuple, upto: int | None = None) -> float:
    """`parallel.spatial.volume`'s halo bytes of the model's first `upto` conv/pool layers."""
    from ..parallel.spatial.volume import halo_bytes_of_layers
    return float(halo_bytes_of_layers(_geometry(spec)[:upto], space))


def _stage_geometry(spec: ModelSpec, plan: Plan, stage: int) -> tuple[int, int, bool]:
    """(first, one past last) index into `_geometry` of the conv/pool layers pipeline `stage`
    holds, and whether it is the last stage."""
    n = len(_geometry(spec))
    if plan.pipe == 1 or not spec.pipe_layer_spatial:
        return 0, n, True
    bounds = stage_bounds(spec, plan)
    counts = spec.pipe_layer_spatial
    return (sum(counts[:bounds[stage]]), sum(counts[:bounds[stage + 1]]),
            stage == plan.pipe - 1)


def _transition_index(spec: ModelSpec, space: tuple) -> int:
    """Index of the first conv/pool layer whose output no longer divides over the grid (the
    split region's all-gather comes before it), or len(_geometry) (at the Flatten)."""
    for k, (_layer, _shape, out_shape) in enumerate(_geometry(spec)):
        if any(out_shape[2 + i] % space[i] for i in range(3)):
            return k
    return len(_geometry(spec))


def _cut_bytes(spec: ModelSpec, plan: Plan, layer: int) -> float:
    """fp32 bytes per sample of the activations a cut before pipe layer `layer` sends (batch-
    first tensors of 2+ dims; a 5-D one that divides over the space grid is split over it)."""
    total = 0.0
    for shape in spec.pipe_cut_shapes[layer]:
        if len(shape) < 2:
            continue   # e.g. position ids: no batch dimension
        n = 4.0 * math.prod(shape[1:])
        if len(shape) == 5 and plan.space_degree > 1 and \
                not any(shape[2 + i] % plan.space[i] for i in range(3)):
            n /= plan.space_degree
        total += n
    return total


def _transition_bytes(spec: ModelSpec, space: tuple) -> float:
    """Per sample, the all-gather that ends the split region (`parallel.spatial.convert`): before
    the first layer whose output no longer divides over the grid (its whole input), else at the
    Flatten (the flattened features)."""
    for _layer, shape, out_shape in _geometry(spec):
        if any(out_shape[2 + i] % space[i] for i in range(3)):
            return 4.0 * math.prod(shape[1:])
    return 4.0 * spec.extra.get("flatten_elements", 0)


def _halo_blocks(spec: ModelSpec, space: tuple) -> tuple[float, float]:
    """fp32 bytes per sample on one space rank of the halo-extended inputs of the split region's
    convolutions (`parallel.spatial.layers.HaloConv`: it saves its block + halos, where a serial
    convolution saves its input): (the halos' bytes over all of them, the largest extended input).
    Per split dim an extended block is (m - 1)·stride + dilation·(kernel - 1) + 1 of m outputs."""
    from torch import nn
    extra = largest = 0.0
    for layer, shape, out_shape in _geometry(spec):
        if any(out_shape[2 + i] % space[i] for i in range(3)):
            continue   # runs on the gathered tensor: no halo
        if not isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            continue
        ext = block = shape[1]
        for i in range(3):
            n, parts = shape[2 + i], space[i]
            if parts == 1:
                ext, block = ext * n, block * n
                continue
            m = out_shape[2 + i] // parts
            k, s, d = layer.kernel_size[i], layer.stride[i], layer.dilation[i]
            ext *= max((m - 1) * s + d * (k - 1) + 1, n // parts)
            block *= n // parts
        extra += 4.0 * (ext - block)
        largest = max(largest, 4.0 * ext)
    return extra, largest


# ----------------------------------------------------------------------------------- the model
def activation_bytes(spec: ModelSpec, plan: Plan, options: Options, stage: int = 0) -> float:
    """Bytes of activations alive at the peak of one step on the rank of pipeline `stage`."""
    m = _microbatches(plan, options)
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
    if plan.pipe > 1:
        # GPipe keeps every micro-batch; 1F1B's stage s warms up with p - s of them
        in_flight = m if options.schedule == "gpipe" else min(m, plan.pipe - stage)
        act = act / plan.pipe * in_flight
    return act * scale * mb


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
    # backward holds the gradient of the largest activation and of its input at once
    transient = 2 * spec.largest_act_bytes * PRECISION_BYTES[options.precision] / 4 \
        * samples_per_rank(plan, options) / _microbatches(plan, options) / plan.space_degree
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
        mb = samples_per_rank(plan, options) / _microbatches(plan, options)
        scale = PRECISION_BYTES[options.precision] / 4
        halos, largest_ext = _halo_blocks(spec, plan.space)
        acts += halos * mb * scale
        gathered = _transition_bytes(spec, plan.space)
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
    cores = system.measured.get("cores") if system.measured else None
    if cores:   # a CPU system: rates are per core; local ranks get cores // ranks threads each
        local = min(world, system.ranks_per_node)
        rate *= max(1, cores // local) * min(1.0, cores / local)
    flops = spec.flops_per_sample * options.batch / world
    if options.checkpointing == "full":
        flops *= 4 / 3
    elif options.checkpointing == "selective" and spec.family == "gpt":
        # Korthikanti et al.: recompute only attention's softmax block, QKᵀ and ·V forward
        flops += 4 * spec.blocks * spec.tokens * spec.extra["n_embd"] * spec.tokens \
            * options.batch / world
    compute = flops / rate
    backward = compute * 2 / 3
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
    m = _microbatches(plan, options)
    bubble = 0.0
    if plan.pipe > 1:   # the schedule's own formula (`parallel.pipe.bubble_formula`)
        from ..parallel.pipe import bubble_formula
        idle = bubble_formula(options.schedule, plan.pipe, m, _virtual(options))
        bubble = compute * idle / (1 - idle)
    mem_bw = system.memory_bandwidth or system.measured.get("memory_bandwidth", 0) or 1e12
    optimizer = 3 * memory["state"] / mem_bw
    calls = overheads.counts(spec, plan, options, comm_list, len(shapes), m)
    fixed = overheads.seconds(calls, system)
    step = compute + exposed + bubble + optimizer + sum(fixed.values())
    return Prediction(plan, options, memory, step,
                      {"compute": compute, "comm_exposed": exposed, "bubble": bubble,
                       "optimizer": optimizer, **fixed}, comm_list, by_stage, calls)
