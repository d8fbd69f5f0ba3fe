"""Sequence parallelism under 1D tensor parallelism (`parallel.sequence_parallel`).

Between the column → row pairs of an nn.ModuleList of transformer blocks the activations are
split along the tokens (dim `SEQ_DIM`) over `tensor`: the region's first block scatters its input
(backward: all-gather), its last block all-gathers its output; each pair's module gathers its
input whole on entry (backward: its own chunk) and keeps its chunk of the output on exit
(backward: all-gather). Outside the pairs every module of a block must treat each token on its
own (`pairs.TOKEN_LOCAL`); attention must be a split pair. The bytes are linear1d.py's formulas;
the ones of the last forward are kept in `bytes` for `TensorParallel.bytes_per_step`. Dropout
masks: `reseed(shared, site)`, the strategy's, gives shards their own masks and replicated
activations the group's.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ...comm import Axis
from ...comm.autograd import gather, scatter
from .heads import head_count_attrs
from .linear1d import SEQ_DIM
from .pairs import TOKEN_LOCAL, attention_head_dim, find_pairs
from ...errors import ConfigError, TensorSplitError


class SequenceParallel:
    """The sequence-parallel regions of one converted model and the hooks at their borders."""

    def __init__(self, tensor: Axis, reseed):
        self.tensor = tensor
        self.reseed = reseed                      # (shared, site): the strategy's dropout seeds
        self.regions: list[str] = []              # names of the split nn.ModuleLists
        self.pair_parents: list[nn.Module] = []   # the pairs' modules inside them
        self.bytes: dict[str, int] = {}           # this forward's, by hook

    @staticmethod
    def candidates(root: nn.Module, use_pairs: bool, three_d: bool) -> list[nn.Module]:
        """The nn.ModuleLists of blocks whose every block holds a column → row pair, or a
        refusal that says why there is none."""
        if three_d:
            raise ConfigError("parallel.sequence_parallel applies to 1D tensor parallelism "
                              "(Plan(tensor=N)); under the 3D grid the batch is already split "
                              "over tensor_z. Set parallel.sequence_parallel=false.")
        pair_parents = {id(m) for _n, m, _c, _r in find_pairs(root)} if use_pairs else set()
        regions = []
        for module in root.modules():
            if isinstance(module, nn.ModuleList) and len(module) and all(
                    any(id(m) in pair_parents for m in block.modules()) for block in module):
                regions.append(module)
        if not regions:
            raise TensorSplitError(
                "parallel.sequence_parallel needs the model's transformer blocks in an "
                "nn.ModuleList (called one after the other) whose every block holds a "
                "column → row pair of Linears; this model has none. Set "
                "parallel.sequence_parallel=false.")
        return regions

    def install(self, root: nn.Module, regions: list[nn.Module]) -> None:
        """Refuse blocks that are not token-local outside their pairs; hook the regions' ends
        and the pairs' parents."""
        names = {id(m): n for n, m in root.named_modules()}
        applied = {id(m) for m in self.pair_parents}
        for region in regions:
            # outside the split pairs, a block must treat tokens independently: its attention
            # has to be a split pair (whose input is gathered whole), its leaves token-local
            stack = list(region.children())
            while stack:
                module = stack.pop()
                if id(module) in applied:
                    continue
                leaf = not any(True for _ in module.children())
                # attention: a head size, or a head count (nanoGPT's fused c_attn has only n_head)
                if attention_head_dim(module) is not None or head_count_attrs(module) or \
                        isinstance(module, nn.MultiheadAttention) \
                        or leaf and not isinstance(module, TOKEN_LOCAL):
                    raise TensorSplitError(
                        f"parallel.sequence_parallel: {names.get(id(module), module)} "
                        f"({type(module).__name__}) would see a shard of the sequence: "
                        "attention must be a split column → row pair (its Linears must divide "
                        f"tensor={self.tensor.size}, heads included) and every other module of "
                        "the blocks token-local (norms, dropout, activations, Linear). Set "
                        "parallel.sequence_parallel=false.")
                stack.extend(module.children())
        sites = iter(range(10 ** 9))
        for region in regions:
            self.regions.append(names.get(id(region), "?"))
            region[0].register_forward_pre_hook(partial(self._enter, next(sites)))
            region[len(region) - 1].register_forward_hook(partial(self._exit, next(sites)))
        for parent in self.pair_parents:
            parent.register_forward_pre_hook(partial(self._pair_enter, next(sites)))
            parent.register_forward_hook(partial(self._pair_exit, next(sites)))

    def _record(self, key: str, t: torch.Tensor) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + t.numel() * t.element_size()

    def _enter(self, site, _module, args):
        x, *rest = args
        if x.dim() < 2 or x.shape[SEQ_DIM] % self.tensor.size:
            raise TensorSplitError(
                f"sequence parallelism splits dim {SEQ_DIM} (the tokens) of the blocks' input "
                f"{tuple(x.shape)} over tensor={self.tensor.size} ranks (rank {self.tensor.rank})"
                f": use a sequence length divisible by {self.tensor.size}, or set "
                "parallel.sequence_parallel=false.")
        if x.requires_grad and torch.is_grad_enabled():
            self._record("enter", x)                       # backward all-gather
        self.reseed(False, site)
        return (scatter(x, self.tensor, SEQ_DIM), *rest)

    def _exit(self, site, _module, _args, out):
        full = gather(out, self.tensor, SEQ_DIM)          # forward all-gather
        self._record("exit", full)
        self.reseed(True, site)
        return full

    def _pair_enter(self, site, _module, args):
        x, *rest = args
        full = gather(x, self.tensor, SEQ_DIM)            # backward: own chunk (f sums)
        self._record("pair_enter", full)
        self.reseed(True, site)
        return (full, *rest)

    def _pair_exit(self, site, _module, _args, out):
        if out.requires_grad and torch.is_grad_enabled():
            self._record("pair_exit", out)                 # backward all-gather
        self.reseed(False, site)
        return scatter(out, self.tensor, SEQ_DIM)
