"""What one rank does under a Plan, before any cost: the run's Options, the groups its
collectives span, the samples and micro-batches it processes, and the parameter shapes it holds
after the tensor and pipe splits. The cost model (`cost`) and the byte formulas (`traffic`) read
these.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..plan import Plan
from .spec import ModelSpec

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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


def microbatches(plan: Plan, options: Options) -> int:
    if plan.pipe == 1:
        return 1
    return options.microbatches or 2 * plan.pipe   # parallel.microbatches = 0: two per stage


def stages_per_rank(options: Options) -> int:
    """Stages per rank: the looped schedules hold several."""
    return options.virtual_stages if options.schedule in ("interleaved", "zero_bubble") else 1



# ----------------------------------------------------------------------------------- parameters
def stage_params(spec: ModelSpec, plan: Plan, vocab_parallel: bool = False) -> list[list]:
    """The parameter shapes each pipeline stage's rank holds after the tensor split (one list
    without pipe)."""
    shapes = list(spec.param_shapes)
    t = plan.tensor_degree
    if t > 1 and spec.family == "cosmoflow" and not plan.tensor_3d:
        shapes = list(cnn_tensor_parts(spec, t, 4)[2])   # channel/filter and Linear splits
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


def cnn_tensor_parts(spec: ModelSpec, t: int, element_size: int) -> tuple:
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
