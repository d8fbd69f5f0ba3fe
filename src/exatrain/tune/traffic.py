"""Every collective of one training step under a Plan: bytes and calls per mesh axis, in the
ledger's convention, from the strategies' own byte formulas (`zero_state_formula`'s sharding,
`parallel.tensor.linear1d`, `Linear3D.bytes_per_step`, `parallel.spatial.volume`'s halos,
`parallel.pipe`'s cuts). The cost model (`cost.predict`) prices them on the system's links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan import Plan
from .layout import (PRECISION_BYTES, Options, cnn_tensor_parts, group, microbatches,
                     samples_per_rank, stage_bounds, stages_per_rank)
from .spec import ModelSpec


@dataclass
class Comm:
    axis: str          # the ledger's axis name ("data", "data+space", "tensor", ...)
    op: str
    nbytes: float      # per step, ledger convention
    calls: int
    size: int          # ranks in the group
    span: int          # first to one past last rank of the group (row-major mesh)
    overlap: str = ""  # "backward" | "compute" | ""



def comms(spec: ModelSpec, plan: Plan, options: Options, psi: int, shapes: list,
          stage: int = 0) -> list[Comm]:
    """Every collective of one training step on a rank of pipeline `stage` holding `shapes`
    (Ψ = `psi`), ledger convention."""
    from ..parallel.tensor.linear1d import column_bytes, row_bytes, shared_input_bytes

    out: list[Comm] = []
    grad = 4  # gradients are reduced in fp32 under every precision policy
    mb = samples_per_rank(plan, options)
    m = microbatches(plan, options)

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
            add(("space",), "all_gather", transition_bytes(spec, plan.space) * mb, 1)

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
        per_op = cnn_tensor_parts(spec, t, PRECISION_BYTES[options.precision])[4]
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
        v = stages_per_rank(options)
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
        channels = cnn_tensor_parts(spec, plan.tensor_degree, 4)[3]
    replicas = ("data", "shard") if plan.shard > 1 else ("data",)
    geometry = _geometry(spec)
    convs = [k for k, (layer, _i, _o) in enumerate(geometry) if isinstance(layer, nn.Conv3d)]
    g0, g1, _ = _stage_geometry(spec, plan, stage)
    at = _transition_index(spec, plan.space) if plan.space_degree > 1 else len(geometry)
    micro = microbatches(plan, options)
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
    m = microbatches(plan, options)
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


def transition_bytes(spec: ModelSpec, space: tuple) -> float:
    """Per sample, the all-gather that ends the split region (`parallel.spatial.convert`): before
    the first layer whose output no longer divides over the grid (its whole input), else at the
    Flatten (the flattened features)."""
    for _layer, shape, out_shape in _geometry(spec):
        if any(out_shape[2 + i] % space[i] for i in range(3)):
            return 4.0 * math.prod(shape[1:])
    return 4.0 * spec.extra.get("flatten_elements", 0)


def halo_blocks(spec: ModelSpec, space: tuple) -> tuple[float, float]:
    """fp32 bytes per sample on one space rank of the halo-extended inputs of the split region's
    convolutions (`parallel.spatial.conv.HaloConv`: it saves its block + halos, where a serial
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
