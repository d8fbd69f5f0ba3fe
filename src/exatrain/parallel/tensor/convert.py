"""Tensor parallelism on the `tensor` axis: 1D (Megatron) or 3D (AxoNN), composed with `data` (4D).

`parallelize_tensor(model, mesh, options)` is "easy mode": it takes an unmodified model and returns
a new module tree (the input model is not modified and nothing global is patched) in which

  * every pair of Linears that chains through feature-local operations inside one module (a
    module whose direct children are ≥ 2 Linears plus activations/dropout, the last Linear reading
    what the others write: an MLP's fc_in → fc_out, attention's q/k/v → out_proj) becomes a
    column → row pair (1D) or a plain → transposed 3D chain, with no re-layout in between. A
    module with an integer `head_dim` attribute is attention: its split must keep whole heads.
  * every other Linear whose shapes divide the grid becomes a column layer that gathers its
    output (1D) or a 3D layer that converts activations into and out of its layout (3D);
  * under 1D, convolutions are split channel/filter-wise (cnn.py, conv.py): filter → channel
    pairs inside nn.Sequentials, the others filter-parallel with a gathered output; under
    Plan(space=..., tensor=...) only those from the switch point on (switch.py), the earlier
    ones run split over `space`, and every gradient is also summed over `space`;
  * everything else (embeddings, norms, Linears that do not divide, tied weights, weights the
    forward reads outside their layer, the Linears of PyTorch's own transformer layers) stays
    whole on every rank, i.e. data-parallel over the tensor group.

Pairs are found from module structure and verified on the first training forward (pairs.py);
`pairs=False` splits Linears one at a time.

Sequence parallelism (1D, `options.sequence_parallel`): between the pairs of an nn.ModuleList of
blocks the activations are split along the tokens (sequence.py). Blocks whose attention is not a
split pair, or with modules that are not token-local, are refused.

A model on the meta device is split before anything is allocated: each rank gets uninitialised
memory for its parts only; load weights with `state.load_full_state_dict`.

The parallelized model takes the same full batch as the plain one on every rank of a tensor group
and returns the same full output, so the loss and the Trainer are unchanged. Under 3D the batch
is split over tensor_z at the model's boundary (zero-padded to a multiple of |z|; the output is
all-gathered over z and trimmed), which is AxoNN's layout: z acts as data parallelism for the
non-Linear parts and as ZeRO-3 sharding for the weights. Models with batch norm are refused
under tensor_z > 1 (per-shard statistics would differ from serial).

Gradient synchronisation (`gradsync.GradSync`) follows each parameter's metadata:

    split weights / biases           mean over data (the 3D weight's reduce-scatter already summed
                                     over z; a 3D bias also sums over z)
    whole parameters, 1D             mean over data (the tensor ranks compute identical gradients)
    whole parameters, 3D             sum over tensor_z (each z-rank saw part of the batch), mean
                                     over data: one all-reduce over data+tensor_z
    whole parameters inside a
    sequence-parallel region         sum over tensor, mean over data

Attention heads: a split attention module's head-count attributes (`n_head`, `n_heads`,
`num_heads`, `num_attention_heads`) are set to the rank's local head count, and a forward that
cannot run on a share of the heads (`C // self.n_head`) is refused before training (heads.py).

Dropout: at each training forward the tensor group agrees on one seed (an 8-byte broadcast on
the tensor axis, tag "control", derived on rank 0 from its last torch.manual_seed without drawing
from its stream), offset by the z coordinate, so replicated activations get identical masks on
every rank holding them. The forward draws from exatrain's stream and the user's global random
state is restored when the forward returns (rng.py). Masks inside split regions (attention
heads, sequence shards) come from the same stream, so they are valid masks but not the ones a
serial run would draw.

Communication per step is the sum of the per-layer formulas in linear1d.py / linear3d.py, the
boundary conversions and the gradient all-reduce; `TensorParallel.bytes_per_step()` evaluates
it for the shapes of the last step, and `exatrain bench tensor` checks the ledger against it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from ...comm import broadcast
from ...mesh import Mesh
from ..gradsync import GradSync, set_grad_axes
from .heads import head_count_attrs, localize_heads
from .cnn import split_convolutions
from .pairs import PairCheck, attention_head_dim, find_pairs
from .switch import conv_selection
from .tree import clone_tree, materialize, tied_parameters
from .linear1d import ColumnParallelLinear, RowParallelLinear, SharedInput
from .linear3d import Grid3D, Linear3D, SharedScatter, gather_batch, scatter_batch

# modules whose Linears stay whole: their own forward reads the Linears' weights directly
# (MultiheadAttention's projections; PyTorch's encoder/decoder layers' fused fast path, taken in
# evaluation, which parallel/reads.py cannot watch: a watched forward never takes it)
WHOLE_INSIDE = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
from .rng import ForwardRng
from .sequence import SequenceParallel
from ...errors import TensorSplitError

# ---------------------------------------------------------------------------- the strategy
class TensorParallel:
    """What parallelize_tensor did to one model: its layers, axes, hooks and byte formula.

    Reachable as `model.exatrain_tensor` on the returned model.
    """

    def __init__(self, mesh: Mesh, options, pairs: bool, overlap: bool, prefetch: bool,
                 device=None, replica_axes=("data",), partial_axes=(), conv_eligible=()):
        plan = mesh.plan
        # the axes this strategy averages gradients over; () when another strategy (shard) does
        self.replica_axes = tuple(a for a in replica_axes if mesh.axis(a).size > 1)
        # the axes over which every gradient is summed (`space`: partial sums of each sample)
        self.partial_axes = tuple(a for a in partial_axes if mesh.axis(a).size > 1)
        self.conv_eligible = set(conv_eligible)   # convolutions to split (cnn.py), by name
        self.convs: dict = {"pairs": [], "gathered": [], "whole": [], "batchnorms": []}
        self.device = device if device is not None else mesh.device
        self.mesh, self.options = mesh, options
        self.three_d = plan.tensor_3d
        self.tensor = mesh.axis("tensor")
        self.sequence_parallel = bool(getattr(options, "sequence_parallel", False))
        self.use_pairs = pairs
        if self.three_d:
            self.grid = Grid3D(mesh.axis("tensor_x"), mesh.axis("tensor_y"),
                               mesh.axis("tensor_z"), self.tensor, overlap=overlap,
                               prefetch=prefetch)
            self.z = self.grid.z
        else:
            self.grid = None
            self.z = None
        self.layers: list[nn.Module] = []            # every parallel Linear
        self.shared: list = []                       # SharedInput / SharedScatter objects
        self.pairs: list[str] = []                   # names of parents whose Linears chain
        self.split_names: list[str] = []             # names of the Linears that were split
        self.whole_names: list[str] = []             # Linears left whole (did not divide)
        self.gradsync: GradSync | None = None
        self._seed = 0
        self.rng = ForwardRng()
        self.local_heads: dict[str, dict[str, int]] = {}  # module name -> {attribute: heads}
        self._boundary = {"rows_out": 0, "rows_in_grad": 0, "seed": 0}
        self.sequence = SequenceParallel(self.tensor, self._reseed)

    # ------------------------------------------------------------------ construction
    @property
    def _heads_split(self) -> tuple[int, str]:
        """How many parts a split attention module's heads go into, and over which axis."""
        return (self.grid.x.size, "tensor_x") if self.three_d else (self.tensor.size, "tensor")

    def _fits_pair(self, cols: list[nn.Linear], row: nn.Linear, head_dim: int | None) -> bool:
        if self.three_d:
            X, Y, Z = self.grid.x.size, self.grid.y.size, self.grid.z.size
            ok = all(c.out_features % (X * Z) == 0 and c.in_features % Y == 0 for c in cols) and \
                row.out_features % (Y * Z) == 0 and row.in_features % X == 0
            heads_split = X
        else:
            P = self.tensor.size
            ok = all(c.out_features % P == 0 for c in cols) and row.in_features % P == 0
            heads_split = P
        if ok and head_dim is not None:
            ok = all((c.out_features // heads_split) % head_dim == 0 for c in cols)
        return ok

    def _fits_single(self, linear: nn.Linear) -> bool:
        if self.three_d:
            X, Y, Z = self.grid.x.size, self.grid.y.size, self.grid.z.size
            return linear.out_features % (X * Z) == 0 and linear.in_features % Y == 0
        return linear.out_features % self.tensor.size == 0

    def apply(self, root: nn.Module) -> nn.Module:
        tied = tied_parameters(root)
        done: set[int] = set()
        replaced: list[nn.Module] = []   # kept alive until the end: their ids stay unique
        sp_candidates = SequenceParallel.candidates(root, self.use_pairs, self.three_d) \
            if self.sequence_parallel else []
        # a list, not only ids: the modules stay alive, so no new module can reuse their ids
        sp_modules = [m for region in sp_candidates for m in region.modules()]
        in_sp = {id(m) for m in sp_modules}

        if self.use_pairs:
            for parent_name, parent, col_names, row_name in find_pairs(root):
                cols = [getattr(parent, n) for n in col_names]
                row = getattr(parent, row_name)
                heads = head_count_attrs(parent)
                head_dim = attention_head_dim(parent) or (
                    cols[0].out_features // min(heads.values()) if heads else None)
                if any(id(p) in tied for l in (*cols, row) for p in l.parameters()) or \
                        not self._fits_pair(cols, row, head_dim):
                    continue
                if heads:  # before anything is split: a refusal leaves nothing half-done
                    self.local_heads[parent_name] = localize_heads(parent_name, parent,
                                                                   *self._heads_split,
                                                                   col_names, row_name)
                sp = id(parent) in in_sp
                if self.three_d:
                    shared = SharedScatter(self.grid.y)
                    for n, c in zip(col_names, cols):
                        setattr(parent, n, Linear3D.from_linear(
                            c, self.grid, transpose=False, gather_output=False,
                            shared_input=shared))
                    setattr(parent, row_name, Linear3D.from_linear(
                        row, self.grid, transpose=True, scatter_input=False))
                else:
                    shared = SharedInput(self.tensor)
                    for n, c in zip(col_names, cols):
                        setattr(parent, n, ColumnParallelLinear.from_linear(
                            c, self.tensor, shared_input=shared))
                    setattr(parent, row_name, RowParallelLinear.from_linear(row, self.tensor))
                parent.register_forward_hook(shared.reset)
                PairCheck(parent_name, parent, [getattr(parent, n) for n in col_names],
                           getattr(parent, row_name), col_names, row_name)
                if sp:
                    self.sequence.pair_parents.append(parent)
                self.shared.append(shared)
                self.layers += [getattr(parent, n) for n in (*col_names, row_name)]
                self.pairs.append(parent_name)
                prefix = f"{parent_name}." if parent_name else ""
                self.split_names += [prefix + n for n in (*col_names, row_name)]
                done |= {id(c) for c in cols} | {id(row)}
                replaced += [*cols, row]

        for name, module in list(root.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is not nn.Linear or id(child) in done:
                    continue
                full_name = f"{name}.{child_name}" if name else child_name
                done.add(id(child))
                if any(id(p) in tied for p in child.parameters()) or \
                        isinstance(module, WHOLE_INSIDE) or \
                        id(child) in in_sp or not self._fits_single(child):
                    self.whole_names.append(full_name)
                    continue
                if self.three_d:
                    layer = Linear3D.from_linear(child, self.grid)
                else:
                    layer = ColumnParallelLinear.from_linear(child, self.tensor, gather_output=True)
                setattr(module, child_name, layer)
                self.layers.append(layer)
                self.split_names.append(full_name)

        if self.conv_eligible and not self.three_d:
            done_convs = split_convolutions(root, self.tensor, self.conv_eligible.__contains__,
                                            tied)
            self.layers += done_convs.pop("layers")
            self.convs = done_convs
            self.split_names += [n for pair in done_convs["pairs"] for n in pair]
            self.split_names += done_convs["gathered"]

        if not self.layers:
            shapes = sorted({(m.in_features, m.out_features) for m in root.modules()
                             if isinstance(m, nn.Linear)})
            has_convs = any(isinstance(m, nn.modules.conv._ConvNd) for m in root.modules())
            if has_convs and self.mesh.plan.space_degree > 1 and not self.three_d \
                    and not self.conv_eligible:
                # the switch rule (parallel/tensor/switch.py) kept every convolution on `space`
                # (convolutions chosen but not dividing t fall to the message below)
                raise TensorSplitError(
                    f"{self.mesh.plan}: no layer is left for the tensor axis. Under space x "
                    f"tensor a convolution goes to channel/filter parallelism only where that "
                    f"moves fewer bytes than the spatial split (or where parallel.chanfilt_from "
                    f"says, less parallel.chanfilt_skip); for this model and input none does "
                    f"(its activations outweigh its weights at every layer), "
                    f"and no Linear divides {self.mesh.plan.tensor} (Linear (in, out) shapes: "
                    f"{shapes[:8]}). Use Plan(space=...) alone (put the tensor ranks on data), "
                    f"or name the first convolution to split with parallel.chanfilt_from (in a "
                    f"model with skip connections, e.g. a segmentation model, one after they "
                    f"join).")
            kept = [name for name, m in root.named_modules()
                    if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))
                    and (is_parametrized(m) or any(id(p) in tied for p in m.parameters()))]
            why = (f"; {', '.join(kept[:8])} stay whole, their weights tied, read outside their "
                   f"layer or computed by a weight or spectral norm (a split would change what "
                   f"they compute)" if kept else "")
            raise TensorSplitError(
                f"{self.mesh.plan}: no Linear or convolution of the model can be split over the "
                f"tensor grid {self.mesh.plan.tensor}{why}; {'no other' if kept else 'none'} "
                f"divides it (Linear (in, out) shapes: {shapes[:8]}). Tensor parallelism would "
                f"only replicate the model. "
                f"Use data parallelism (tensor=1), or pick degrees that divide the feature or "
                f"channel counts.")

        materialize(root, self.device)
        if self.sequence_parallel:
            self.sequence.install(root, sp_candidates)
        self._set_grad_metadata(root, sp_candidates)
        if self.three_d and self.z.size > 1:
            batch_norms = [n for n, m in root.named_modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            if batch_norms:
                raise TensorSplitError(
                    f"{self.mesh.plan}: tensor_z={self.z.size} splits each batch over z, but the "
                    f"model has batch norm ({', '.join(batch_norms[:3])}), whose statistics "
                    "would then differ from serial training. Use tensor_z=1 (e.g. tensor="
                    f"({self.grid.x.size}, {self.grid.y.size * self.z.size}, 1)).")
        root.register_forward_pre_hook(self._before, with_kwargs=True)
        root.register_forward_hook(self._after)
        bucket = getattr(self.options, "bucket_cap_mb", 25.0)
        self.gradsync = GradSync(root.parameters(), self.mesh, bucket_cap_mb=bucket)
        return root

    # ------------------------------------------------------------------ dropout seeds
    def _reseed(self, shared: bool, site: int) -> None:
        """Dropout seeds inside a training forward: `shared` ones are equal on the tensor group
        (replicated activations), the others differ per rank (sequence shards). `site` numbers
        the hook, so every block draws new masks and a recomputed block (activation
        checkpointing) draws the same ones again."""
        if self._is_training:
            offset = 0 if shared else 1 + self.tensor.rank
            self.rng.reseed((self._seed + 1_000_003 * (site + 1) + offset) % 2 ** 63)

    # ------------------------------------------------------------------ gradients
    def _set_grad_metadata(self, root: nn.Module, sp_regions: list[nn.Module]) -> None:
        mean = self.replica_axes
        sp_params = {id(p) for region in sp_regions for p in region.parameters()}
        for p in root.parameters():
            if hasattr(p, "exatrain_grad_sum_axes") or getattr(p, "exatrain_layout", ()):
                sum_axes = getattr(p, "exatrain_grad_sum_axes", ())  # set by the layer itself
            elif id(p) in sp_params:
                sum_axes = ("tensor",)
            elif self.three_d and self.z.size > 1:
                sum_axes = ("tensor_z",)
            else:
                sum_axes = ()
            set_grad_axes(p, (*sum_axes, *self.partial_axes), mean)

    # ------------------------------------------------------------------ model boundary
    def _before(self, module, args, kwargs):
        self._is_training = module.training and torch.is_grad_enabled()
        self.sequence.bytes = {}
        if self._is_training and self.tensor.size > 1:
            seed = torch.zeros(1, dtype=torch.int64, device=self.mesh.device)
            if self.tensor.rank == 0:
                seed.fill_(self.rng.next_seed())
            broadcast(seed, self.tensor, src=0, tag="control")
            self._seed = int(seed)
            self._boundary["seed"] = seed.numel() * seed.element_size()
            self.rng.enter(self._seed + (self.z.rank if self.z is not None else 0))
        if not self.three_d or self.z.size == 1:
            return None
        batch = None

        def split(t):
            nonlocal batch
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            if batch is None:
                batch = t.shape[0]
            elif t.shape[0] != batch:
                raise TensorSplitError(
                    f"tensor_z={self.z.size} splits the batch (dim 0) of every tensor argument, "
                    f"but the model got dim-0 sizes {batch} and {t.shape[0]}; pass batch-first "
                    "tensors of one batch size.")
            if t.requires_grad and torch.is_grad_enabled():
                self._boundary["rows_in_grad"] += (-t.shape[0] % self.z.size + t.shape[0]) * \
                    (t.numel() // max(t.shape[0], 1)) * t.element_size()
            return scatter_batch(t, self.z)

        self._boundary["rows_in_grad"] = 0
        args = tuple(split(a) for a in args)
        kwargs = {k: split(v) for k, v in kwargs.items()}
        self._batch = batch
        return args, kwargs

    def _after(self, module, args, output):
        self.rng.exit()  # the user's random state, as it was before the forward
        if not self.three_d or self.z.size == 1 or self._batch is None:
            return output
        batch, self._batch = self._batch, None
        total = 0

        def join(t):
            nonlocal total
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                total += t.numel() * t.element_size() * self.z.size
                return gather_batch(t, self.z, batch)
            if isinstance(t, (tuple, list)):
                return type(t)(join(v) for v in t)
            if isinstance(t, dict):
                return {k: join(v) for k, v in t.items()}
            return t

        output = join(output)
        self._boundary["rows_out"] = total
        return output

    _is_training = False
    _batch = None

    # ------------------------------------------------------------------ the byte formula
    def bytes_per_step(self) -> dict[str, int]:
        """Per-axis bytes of one training step (forward + backward + gradient sync), from the
        formulas of linear1d / linear3d / gradsync and the boundary conversions, for the
        shapes seen in the last forward."""
        total: dict[str, int] = {}

        def add(parts: dict[str, int]) -> None:
            for k, v in parts.items():
                if v:
                    total[k] = total.get(k, 0) + v

        for layer in self.layers:
            add(layer.bytes_per_step())
        for shared in self.shared:
            element = next(l.weight.element_size() for l in self.layers)
            add(shared.bytes_per_step(element))
        if self.tensor.size > 1:
            add({self.tensor.name: self._boundary["seed"]})
        if self.three_d and self.z.size > 1:
            add({self.z.name: self._boundary["rows_out"] + self._boundary["rows_in_grad"]})
        if self.sequence.regions:
            add({self.tensor.name: sum(self.sequence.bytes.values())})
        add(self.gradsync.bytes_per_step())
        return total

    def summary(self) -> dict:
        return {"plan": str(self.mesh.plan), "split": list(self.split_names),
                "conv_pairs": [list(p) for p in self.convs["pairs"]],
                "conv_gathered": list(self.convs["gathered"]),
                "conv_whole": list(self.convs["whole"]),
                "whole": list(self.whole_names), "chained": list(self.pairs),
                "local_heads": dict(self.local_heads),
                "sequence_parallel_regions": list(self.sequence.regions)}


def parallelize_tensor(model: nn.Module, mesh: Mesh, options=None, *, pairs: bool = True,
                       overlap: bool = True, prefetch: bool = True, replica_axes=("data",),
                       checkpoint_and_compile: bool = True, partial_axes=(),
                       example=None) -> nn.Module:
    """Lay `model` out over the mesh's tensor axes (and data); see the module docstring.

    Returns a new module tree whose parameters have the plain model's names (local parts of split
    ones, see state.py for full-weight state dicts), with gradient synchronisation over data
    and the replicated axes attached, and `no_sync()` for gradient accumulation. `pairs=False`
    converts every Linear on its own (no chaining); `overlap` / `prefetch` switch the 3D
    backward overlap and weight prefetch (for measurement). `replica_axes`: the axes whose
    gradient average this strategy does (() when the shard step owns it, see apply.py);
    `checkpoint_and_compile=False` when apply.py runs that step itself. `partial_axes`: axes
    every gradient is summed over besides (`space`, when spatial parallelism runs the early
    layers). Convolutions are split channel/filter-wise (cnn.py) from the switch point on
    (switch.py; `example`, one batch of inputs, gives it the layer shapes).
    """
    if options is None:
        from ..options import ParallelOptions
        options = ParallelOptions()
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    root = clone_tree(model if on_meta else model.to(mesh.device))
    state = TensorParallel(mesh, options, pairs, overlap, prefetch, device=mesh.device,
                           replica_axes=replica_axes, partial_axes=partial_axes,
                           conv_eligible=conv_selection(model, mesh.plan, options, example))
    root = state.apply(root)
    if checkpoint_and_compile and (options.activation_checkpointing != "none" or options.compile):
        from ..compile import apply_checkpointing_and_compile
        root = apply_checkpointing_and_compile(root, options)
    root.exatrain_tensor = state
    root.no_sync = state.gradsync.no_sync
    root.exatrain_gradsync = state.gradsync  # pipeline stages reduce after the schedule
    return root


__all__ = ["TensorParallel", "parallelize_tensor"]
