"""ModelSpec: what the cost model needs to know about a model, without building it for real.

Measured once per model (not per Plan), in one process and no real memory, by running the real
model under torch's FakeTensorMode (tensors with shapes and dtypes but no storage; the CPU's
kernel choices, e.g. SDPA's, are kept, so the bytes are those a real CPU run saves):

  param_shapes             every parameter's shape, registration order (ZeRO chunk padding)
  act_bytes_per_sample     bytes autograd saves for backward in one forward + loss of one sample
                           (distinct tensors, parameters excluded: `trace_saved_bytes`)
  block_input_bytes        bytes of one block's input per sample (what full checkpointing keeps)
  block_act_bytes          saved bytes of one block's internals per sample (recomputed under
                           full checkpointing; one block's worth is alive at a time in backward)
  boundary_bytes           the activation crossing a pipeline stage boundary, per sample
  flops_per_sample         training FLOPs (forward + backward) of one sample
  ops_per_step             aten operators dispatched by one forward + loss + backward (batch 1;
                           the count does not grow with the batch): each is a kernel launch and
                           a trip through Python and the dispatcher, the fixed cost that
                           dominates a step of many small kernels (`cost.overheads`)
  traffic_bytes_per_sample a user's model: the bytes its memory-bound operators (elementwise,
                           reductions, copies: all but views, matrix products and convolutions)
                           read and write in one forward + loss + backward of one sample. A
                           model of elementwise work (a GNN's bases and messages) spends its step
                           there, not in FLOPs. The built-in models' fitted rates include it.
  traffic_bytes_per_step   of a user's model, the bytes its memory-bound operators move once a
                           step whatever the batch (what a trace at batch 4 adds to one at
                           batch 2 is per sample; the rest is this): an embedding table's dense
                           gradient, a parametrized weight computed from its parts.

A GPT is traced with 1 and 2 layers (the difference is one block), so an 80B model costs no more
than a small one. Other models are traced whole at batch 1 (a user's bytes at 2 and 4 too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ArgumentError, ConfigError
from .step_counts import buffers_kept, count_ops, count_step, traffic_split


def trace_saved_bytes(model: nn.Module, inputs, loss_fn, largest: list | None = None,
                      in_loss: list | None = None) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for one forward + loss
    (when `largest` is given, appended to it: the largest one's bytes, and the bytes saved after
    it, which backward has freed by the time it reaches the largest; the last of equal ones;
    when `in_loss` is given, appended to it: the bytes the loss saved, and whether the largest
    is among them)."""
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    keep = []

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
            keep.append(base)          # hold it, so its id is not reused during the trace
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(*inputs)
        before_loss = len(saved)
        loss_fn(output)
    sizes = list(saved.values())   # in the order they were saved
    top = max(sizes, default=0)
    at = max((i for i, n in enumerate(sizes) if n == top), default=0)
    if largest is not None:
        largest.append(top)
        largest.append(sum(sizes[at + 1:]))
    if in_loss is not None:
        in_loss.append(sum(sizes[before_loss:]))
        in_loss.append(bool(sizes) and at >= before_loss)
    return sum(saved.values())


def pipe_structure(model: nn.Module, example: torch.Tensor) -> tuple[list, list, list, list]:
    """The layers `parallel.pipe` may cut before, from one trace of its own tracer: their names,
    each layer's parameters' shapes, the shapes of the values a cut there sends (`live_across`,
    run on the meta device), and each layer's convolution/pooling count."""
    from torch import fx

    from ..parallel.pipe.split import live_across, trace_layers
    layers = trace_layers(model, example)
    shapes: dict = {}

    class Shapes(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                shapes[n] = tuple(out.shape)
            return out

    with torch.no_grad():
        Shapes(fx.GraphModule(layers.model, layers.graph)).run(example.to("meta"))
    cuts = [[shapes[n] for n in live_across(layers, pos) if n in shapes]
            for pos in layers.layer_pos]
    modules = [model.get_submodule(name) for name in layers.layer_names]
    params = [[tuple(p.shape) for p in m.parameters()] for m in modules]
    spatial = [sum(isinstance(sub, (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d)) for sub in m.modules())
               for m in modules]
    return list(layers.layer_names), params, cuts, spatial


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


@dataclass
class ModelSpec:
    family: str                    # gpt | cosmoflow | vit
    name: str
    param_shapes: list
    flops_per_sample: float
    act_bytes_per_sample: float
    block_input_bytes: float
    block_act_bytes: float
    boundary_bytes: float
    blocks: int
    block_ranges: list = field(default_factory=list)  # [start, end) in param_shapes, per block
    tensor_dims: list = field(default_factory=list)    # per parameter: dim 1D tensor splits, or -1
    compute_kind: str = "matmul"   # matmul | conv: which device rate applies
    # GPT: heads and widths that tensor parallelism must divide; CosmoFlow: the sample's grid
    heads: int = 0
    widths: tuple = ()
    spatial_shape: tuple = ()
    tokens: int = 0
    tensor_split_fraction: float = 0.0   # share of activations inside split (tensor) regions
    pipe_layers: list = field(default_factory=list)   # per layer `parallel.pipe` may cut
                                                      # between: its parameters' shapes
    largest_act_bytes: float = 0.0       # the largest saved tensor per sample (backward's
                                         # gradient of it and its input are alive at once)
    after_largest_bytes: float = 0.0     # saved after it (freed before backward reaches it)
    # what the loss saves per sample, and whether the largest saved tensor is the loss's: the
    # step computes the loss on the output cast to fp32 (`train.step`), so these stay 4 bytes an
    # element under bf16 / fp16 (GPT's log-softmax over the vocabulary: the largest tensor)
    loss_act_bytes: float = 0.0
    largest_in_loss: bool = False
    # per pipe layer j: the shapes (batch 1) of what a stage starting at layer j receives
    # (`parallel.pipe.split.live_across`, the strategy's own cut), and how many convolution /
    # pooling layers layer j holds (the spatial strategy's halo layers, in execution order)
    pipe_cut_shapes: list = field(default_factory=list)
    pipe_layer_spatial: list = field(default_factory=list)
    ops_per_step: float = 0.0            # aten operators of forward + loss + backward (batch 1)
    traffic_bytes_per_sample: float = 0.0  # bytes of the memory-bound operators (user models)
    traffic_bytes_per_step: float = 0.0    # of those, what a step moves whatever its batch
    extra: dict = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes)


# ------------------------------------------------------------------------------------------ GPT
def _gpt_tensor_dims(cfg) -> list[int]:
    """Per parameter (registration order), the dim 1D tensor parallelism splits, -1 if whole:
    q/k/v and fc_in are column layers (weight and bias split on dim 0), out_proj and fc_out row
    layers (weight split on dim 1, bias whole); lm_head a column layer (`parallel.tensor.convert`:
    a Linear outside a pair is split when its shapes divide); embeddings and norms stay whole."""
    b = cfg.bias
    ln = [-1, -1] if b else [-1]
    col = [0, 0] if b else [0]
    row = [1, -1] if b else [1]
    block = ln + col * 3 + row + ln + col + row
    return [-1, -1] + block * cfg.n_layer + ln + ([] if cfg.tie_weights else [0])


def _gpt_block_shapes(cfg) -> list[tuple]:
    E, Hm, b = cfg.n_embd, cfg.mlp_hidden, cfg.bias
    ln = [(E,), (E,)] if b else [(E,)]
    block = ln[:]
    for _ in range(4):                       # q, k, v, out
        block += [(E, E)] + ([(E,)] if b else [])
    block += ln
    block += [(Hm, E)] + ([(Hm,)] if b else []) + [(E, Hm)] + ([(E,)] if b else [])
    return block


def gpt_param_shapes(cfg) -> list[tuple]:
    """Every parameter's shape in GPT's registration order (`models.gpt.GPT`)."""
    E, V, T = cfg.n_embd, cfg.vocab_size, cfg.block_size
    ln = [(E,), (E,)] if cfg.bias else [(E,)]
    shapes = [(V, E), (T, E)] + _gpt_block_shapes(cfg) * cfg.n_layer + ln
    if not cfg.tie_weights:
        shapes.append((V, E))
    return shapes


def gpt_pipe_layers_and_cuts(cfg) -> tuple[list, list, list]:
    """`pipe_structure`'s layers, cuts and spatial counts of GPT `cfg`. Its blocks are alike,
    so a GPT of at most three blocks is traced (on the meta device) and the middle block's
    entries stand for every block between the first and the last: the same lists as tracing
    every block (a test holds them equal), without tracing a 128-block model (26 s of
    `exatrain plan` for four published GPTs)."""
    from ..models.gpt import GPT
    traced = min(cfg.n_layer, 3)
    with torch.device("meta"):
        names, layers, cuts, spatial = pipe_structure(
            GPT(cfg.replace(n_layer=traced, dropout=0.0)),
            torch.zeros(1, cfg.block_size, dtype=torch.long))
    first = names.index("blocks.0")

    def every_block(entries: list) -> list:   # blocks.0, blocks.1 as many times as needed, the last
        middle = cfg.n_layer - traced
        return entries[:first + 2] + [entries[first + 1]] * middle + entries[first + 2:]
    return every_block(layers), every_block(cuts), every_block(spatial)


def gpt_spec(cfg, name: str = "") -> ModelSpec:
    from ..models.gpt import GPT, flops_per_token, gpt_loss

    def saved(layers: int) -> int:
        with _fake_mode():
            torch.manual_seed(0)
            model = GPT(cfg.replace(n_layer=layers, dropout=0.0))
            idx = torch.zeros(1, cfg.block_size, dtype=torch.long)
            return trace_saved_bytes(model, (idx,), lambda logits: gpt_loss(logits, idx), biggest,
                                     loss)

    def ops(layers: int) -> int:
        with _fake_mode():
            model = GPT(cfg.replace(n_layer=layers, dropout=0.0))
            idx = torch.zeros(1, cfg.block_size, dtype=torch.long)
            return count_ops(model, (idx,), lambda logits: gpt_loss(logits, idx))

    biggest: list = []
    loss: list = []
    per = len(_gpt_block_shapes(cfg))
    one, two = saved(1), saved(2)
    ops_one, ops_two = ops(1), ops(2)
    layers, cuts, spatial = gpt_pipe_layers_and_cuts(cfg)
    per_block = two - one
    act = one + (cfg.n_layer - 1) * per_block
    x_bytes = cfg.block_size * cfg.n_embd * 4
    # What 1D tensor parallelism does not split inside a block (as in Korthikanti et al. 2022,
    # Table 2): the two layer norms' inputs and outputs, 4 fp32 tensors of T × E per sample;
    # everything else a block saves (q, k, v, attention output, the MLP's hidden) is split.
    split = max(0.0, 1 - 4 * x_bytes / per_block) if per_block else 0.0
    return ModelSpec(
        family="gpt", name=name or f"GPT {cfg.n_layer}x{cfg.n_embd}",
        param_shapes=gpt_param_shapes(cfg), tensor_dims=_gpt_tensor_dims(cfg),
        flops_per_sample=float(cfg.block_size * flops_per_token(cfg, cfg.block_size)),
        act_bytes_per_sample=float(act), block_input_bytes=float(x_bytes),
        block_act_bytes=float(per_block), boundary_bytes=float(x_bytes), blocks=cfg.n_layer,
        block_ranges=[(2 + i * per, 2 + (i + 1) * per) for i in range(cfg.n_layer)],
        heads=cfg.n_head, widths=(cfg.n_embd, cfg.mlp_hidden), tokens=cfg.block_size,
        tensor_split_fraction=split, largest_act_bytes=float(max(biggest[0::2])),
        after_largest_bytes=float(biggest[1]), pipe_layers=layers,
        loss_act_bytes=float(loss[0]), largest_in_loss=bool(loss[1]),
        pipe_cut_shapes=cuts, pipe_layer_spatial=spatial,
        ops_per_step=float(ops_one + (cfg.n_layer - 1) * (ops_two - ops_one)),
        extra={"n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layer,
               "mlp_hidden": cfg.mlp_hidden, "bias": cfg.bias, "tie_weights": cfg.tie_weights})


# ------------------------------------------------------------------------------------ CosmoFlow
def conv_flops(model: nn.Module, x: torch.Tensor) -> float:
    """Training FLOPs (3 × forward multiply-adds × 2) of the convolutions and linears."""
    total = [0.0]

    def hook(m, inp, out):
        if isinstance(m, nn.Conv3d | nn.Conv2d | nn.Conv1d):
            k = math.prod(m.kernel_size) * m.in_channels // m.groups
            total[0] += 2.0 * out.numel() * k
        elif isinstance(m, nn.Linear):
            total[0] += 2.0 * out.numel() * m.in_features
    hooks = [m.register_forward_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return 3.0 * total[0]


def cosmoflow_spec(size: int, base_channels: int = 32, conv_layers: int = 5,
                   in_channels: int = 4, batchnorm: bool = False) -> ModelSpec:
    from ..models.cosmoflow import CosmoFlow

    with _fake_mode():
        model = CosmoFlow(size=size, in_channels=in_channels, base_channels=base_channels,
                          conv_layers=conv_layers, batchnorm=batchnorm)
        x = torch.zeros(1, in_channels, size, size, size)
        y = torch.zeros(1, 4)
        biggest: list = []
        loss: list = []
        act = trace_saved_bytes(model, (x,), lambda out: F.mse_loss(out, y), biggest, loss)
        flops = conv_flops(model, x)
        shapes = [tuple(p.shape) for p in model.parameters()]
        features = len(list(model.features.parameters()))
        flat = model.head[1].in_features
        ops = count_ops(model, (x,), lambda out: F.mse_loss(out, y))
    with torch.device("meta"):
        meta_model = CosmoFlow(size=size, in_channels=in_channels, base_channels=base_channels,
                               conv_layers=conv_layers, batchnorm=batchnorm)
        example = torch.zeros(1, in_channels, size, size, size)
        _, layers, cuts, spatial = pipe_structure(meta_model, example)
    # blocks (checkpointing, `parallel.blocks.find_blocks`): `features` and `head`
    return ModelSpec(family="cosmoflow", name=f"CosmoFlow {size}^3", param_shapes=shapes,
                     flops_per_sample=flops, act_bytes_per_sample=float(act),
                     block_input_bytes=float(in_channels * size ** 3 * 4),
                     block_act_bytes=float(act), boundary_bytes=float(base_channels * size ** 3),
                     blocks=2, block_ranges=[(0, features), (features, len(shapes))],
                     compute_kind="conv", spatial_shape=(size, size, size),
                     largest_act_bytes=float(biggest[0]), after_largest_bytes=float(biggest[1]),
                     loss_act_bytes=float(loss[0]), largest_in_loss=bool(loss[1]),
                     pipe_layers=layers,
                     pipe_cut_shapes=cuts, pipe_layer_spatial=spatial, ops_per_step=float(ops),
                     extra={"size": size, "in_channels": in_channels,
                            "flatten_elements": flat, "base_channels": base_channels,
                            "conv_layers": conv_layers, "batchnorm": batchnorm,
                            "batchnorm_channels": [base_channels * 2 ** i
                                                   for i in range(conv_layers)] if batchnorm
                            else []})


# ---------------------------------------------------------------------------------------- ViT
def vit_spec(img_size: tuple, patch_size: int = 8, channels: int = 3, embed_dim: int = 192,
             depth: int = 4, num_heads: int = 4, mlp_ratio: float = 4.0) -> ModelSpec:
    """The ViT forecaster (`models.vit`): traced whole at batch 1, like CosmoFlow. Its blocks
    are FSDP2's units under ZeRO-3; tensor and pipe are not costed for it (`search`)."""
    from ..models.vit import ViTForecaster, flops_per_sample, relative_l2_loss

    kwargs = dict(img_size=tuple(img_size), patch_size=patch_size, in_channels=channels,
                  out_channels=channels, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                  mlp_ratio=mlp_ratio)
    model = ViTForecaster(**kwargs)   # built for real (its init draws from data): small models
    with _fake_mode():
        x = torch.zeros(1, channels, *img_size)
        biggest: list = []
        loss: list = []
        act = trace_saved_bytes(model, (x,), lambda out: relative_l2_loss(out, x), biggest, loss)
        ops = count_ops(model, (x,), lambda out: relative_l2_loss(out, x))
        shapes = [tuple(p.shape) for p in model.parameters()]
        names = [n for n, _ in model.named_parameters()]
    ranges = []
    for b in range(depth):
        idx = [i for i, n in enumerate(names) if n.startswith(f"blocks.{b}.")]
        ranges.append((idx[0], idx[-1] + 1))
    tokens = (img_size[0] // patch_size) * (img_size[1] // patch_size)
    per_block = act / max(depth, 1)
    return ModelSpec(family="vit", name=f"ViT {depth}x{embed_dim} {img_size[0]}x{img_size[1]}",
                     param_shapes=shapes, flops_per_sample=flops_per_sample(kwargs),
                     act_bytes_per_sample=float(act), block_input_bytes=4.0 * tokens * embed_dim,
                     block_act_bytes=float(per_block), boundary_bytes=4.0 * tokens * embed_dim,
                     blocks=depth, block_ranges=ranges, heads=num_heads,
                     widths=(embed_dim, int(embed_dim * mlp_ratio)), tokens=tokens,
                     largest_act_bytes=float(biggest[0]), after_largest_bytes=float(biggest[1]),
                     loss_act_bytes=float(loss[0]), largest_in_loss=bool(loss[1]),
                     ops_per_step=float(ops),
                     extra={"n_embd": embed_dim, "img_size": tuple(img_size)})


# ---------------------------------------------------------------------------------- a user's
def user_spec(model: nn.Module, example: torch.Tensor, loss_fn=None, name: str = "") -> ModelSpec:
    """A user's own model, traced whole at batch 1 on `example` (one sample (1, C, *spatial), or any
    batch: its first sample is used) under fake tensors, like CosmoFlow: its parameters, saved
    activations, FLOPs (every matrix product and convolution), operators and the bytes its
    memory-bound operators move come from its own layers. Its bytes are traced at batches 2 and 4
    too (`step_counts.traffic_split`), its buffers left as they were. `loss_fn(output)`: the loss
    on the output of a batch of 1, 2 or 4 (one that only takes batch 1 gets batch 1's bytes per
    sample, with a warning); None: a mean square of each of its tensors (what F.mse_loss saves). A
    model whose BatchNorm cannot train on one sample (one value per channel: features (N, C)) is
    traced at batch 2, its figures per sample halved. One block (no checkpointing units known); a
    3D model's convolution and pooling layers give the halos under `space`
    (`parallel.spatial.volume`), and each of its outputs (a model may return a tuple or dict of
    them) that keeps the spatial dims is all-gathered, as `et.fit` does on whole samples."""
    from ..parallel.derivatives import DerivativeCalls
    from ..parallel.nested import tensors_of
    from ..parallel.spatial.volume import layer_geometry
    loss = loss_fn or (lambda out: sum(t.float().square().mean() for t in tensors_of(out)))
    x = torch.zeros((1, *example.shape[1:]), dtype=example.dtype)
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    for batch in (1, 2):
        traced = torch.zeros((batch, *x.shape[1:]), dtype=x.dtype)
        biggest: list = []
        in_loss: list = []
        try:
            with buffers_kept(model), _fake_mode():
                act = trace_saved_bytes(model, (traced,), loss, biggest, in_loss) / batch
                ops, flops, at_one = count_step(model, (traced,), loss)
                per_sample, per_step = traffic_split(model, traced, loss, at_one / batch, name)
                with torch.no_grad(), DerivativeCalls() as derivatives:
                    outs = tensors_of(model(traced))
            break
        except Exception as error:   # noqa: BLE001 - torch's "more than 1 value per channel"
            one_value = isinstance(error, ValueError) and \
                "more than 1 value per channel" in str(error)
            if batch == 1 and one_value:
                continue
            if batch == 2:
                raise ArgumentError(
                    f"{name or type(model).__name__} is traced at batch 2, since its BatchNorm "
                    f"cannot train on one sample (one value per channel), and there it raised "
                    f"{type(error).__name__}: {str(error).rstrip('.')}. Give a loss that takes "
                    "the output of any batch (a target of the output's batch size).") from error
            raise
    flops /= batch
    biggest = [b / batch for b in biggest]
    in_loss = [in_loss[0] / batch, *in_loss[1:]] if in_loss else in_loss
    out_shape = tuple(outs[0].shape)
    shapes = [tuple(p.shape) for p in model.parameters()]
    spatial = tuple(x.shape[2:]) if convs and 1 <= x.dim() - 2 <= 3 else ()
    input_bytes = float(x.numel() * x.element_size())
    extra = {"in_channels": x.shape[1] if x.dim() > 1 else 1,
             # under space on whole samples, an output that keeps the spatial dims is gathered
             "flatten_elements": sum(math.prod(t.shape[1:]) for t in outs if t.dim() == x.dim()),
             "output_shape": out_shape[1:],
             # its forward differentiates (forces): Plans without second derivatives refused
             "differentiates": derivatives.calls > 0,
             "differentiates_by_functorch": derivatives.functorch > 0}
    if len(spatial) == 3:
        extra["geometry"] = layer_geometry(model, tuple(x.shape))
    if spatial:   # a layer the spatial split refuses (a Fourier layer): no space Plan runs
        from ..parallel.spatial.convert import spatial_refusal
        extra["space_refusal"] = spatial_refusal(model)
    from ..parallel.graph import graph_refusal
    extra["tensor_refusal"] = graph_refusal(model)   # DimeNet++: no tensor Plan runs
    kind = "conv" if convs else "matmul"
    return ModelSpec(family="user", name=name or type(model).__name__, param_shapes=shapes,
                     flops_per_sample=flops, act_bytes_per_sample=float(act),
                     block_input_bytes=input_bytes, block_act_bytes=float(act),
                     boundary_bytes=input_bytes, blocks=1, block_ranges=[(0, len(shapes))],
                     compute_kind=kind, spatial_shape=spatial,
                     largest_act_bytes=float(biggest[0]) if biggest else 0.0,
                     loss_act_bytes=float(in_loss[0]) if in_loss else 0.0,
                     largest_in_loss=bool(in_loss[1]) if in_loss else False,
                     after_largest_bytes=float(biggest[1]) if biggest else 0.0,
                     ops_per_step=float(ops), traffic_bytes_per_sample=per_sample,
                     traffic_bytes_per_step=per_step, extra=extra)


def molecular_spec(config) -> ModelSpec:
    """The qm9 and catalysis workloads' model (SchNet or DimeNet++; catalysis: its forces),
    traced on one padded molecule or frame as a user's model is (`user_spec`): its step is
    mostly the bytes of its bases and messages (`traffic_bytes_per_sample`), not FLOPs."""
    if config.run.workload == "catalysis":
        from ..data.catalysis import MAX_ATOMS
        from ..workloads.catalysis import build_model
        model = build_model(config.model)
    else:
        from ..data.qm9 import MAX_ATOMS
        from ..workloads.qm9 import build_model
        model = build_model(config.model)
    rows = torch.zeros(1, MAX_ATOMS, 4)   # [Z, x, y, z]: the shapes are what the trace needs
    name = f"{config.run.workload} {config.model.name}"
    return user_spec(model, rows, lambda out: out.abs().mean(), name=name)


def spec_from_config(config) -> ModelSpec:
    """The ModelSpec of a run config's model (workloads gpt, cosmoflow, vit, qm9, catalysis)."""
    workload = config.run.workload
    if workload == "gpt":
        from ..workloads.gpt import model_config
        cfg = model_config(config.model)
        return gpt_spec(cfg, name=config.model.preset or "")
    if workload == "cosmoflow":
        m = config.model
        return cosmoflow_spec(m.size, m.base_channels, m.conv_layers, batchnorm=m.batchnorm)
    if workload == "vit":
        m, d = config.model, config.data
        return vit_spec((d.height, d.width), m.patch_size, 3, m.embed_dim, m.depth,
                        m.num_heads, m.mlp_ratio)
    if workload in ("qm9", "catalysis"):
        return molecular_spec(config)
    raise ConfigError(f"run.workload={workload!r}: the planner has a cost model for the gpt, "
                      f"cosmoflow, vit, qm9 and catalysis workloads only. Set the Plan of "
                      f"{workload} yourself (its example's default plan, in the workloads "
                      f"reference, trains it) and time it with a short run: exatrain run CONFIG "
                      f"--set train.steps=20.")
