"""Which Linears of a model chain as column → row pairs under tensor parallelism, and the check,
on the first training forward, that they compute what a pair assumes.

Pairs are found from module structure (`find_pairs`) and verified on the first training forward
on the autograd graph (`PairCheck`): a structure that does not compute what a pair assumes is
refused with the module names, never trained wrongly (`parallel.tensor_pairs = false`,
`parallelize_tensor(pairs=False)`, splits Linears one at a time). Sequence parallelism asks the
same modules whether they treat every token on its own (`TOKEN_LOCAL`).
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import TensorSplitError

# Modules through which features stay where they are (elementwise, or identity).
FEATURE_LOCAL = (nn.GELU, nn.ReLU, nn.ReLU6, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
                 nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Hardswish, nn.Hardsigmoid,
                 nn.Hardtanh, nn.Identity, nn.Dropout)


# Modules that treat every token on its own (sequence parallelism may split the tokens for them).
TOKEN_LOCAL = FEATURE_LOCAL + (nn.LayerNorm, nn.RMSNorm, nn.Linear)


def attention_head_dim(module: nn.Module) -> int | None:
    value = getattr(module, "head_dim", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def find_pairs(model: nn.Module) -> list[tuple[str, nn.Module, list[str], str]]:
    """(parent name, parent, column child names, row child name) for each chainable group.

    A parent qualifies when its direct children are ≥ 2 `nn.Linear` (exact type) and otherwise
    only FEATURE_LOCAL modules; its last Linear is the row layer; the other Linears, all with the
    same in_features and out_features == the row's in_features, are the column layers. More than
    one column layer (q, k, v) is accepted only in attention (a parent with an integer
    `head_dim`); containers without a forward of their own (ModuleList, ModuleDict) never qualify.

    The structure is a promise the first training forward checks (`PairCheck`): the row
    layer's input must be computed from the column layers' outputs, through no norm, reduction
    or other matrix multiply, and not from the parent's input directly; otherwise that forward
    raises, naming the modules.
    """
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        linears = [(n, c) for n, c in module.named_children() if type(c) is nn.Linear]
        others = [c for _n, c in module.named_children() if type(c) is not nn.Linear]
        if len(linears) < 2 or not all(isinstance(c, FEATURE_LOCAL) for c in others):
            continue
        if len(linears) > 2 and (attention_head_dim(module) is None
                                 or isinstance(module, nn.Sequential)):
            continue
        row_name, row = linears[-1]
        columns = linears[:-1]
        if all(c.out_features == row.in_features and c.in_features == columns[0][1].in_features
               for _n, c in columns):
            found.append((name, module, [n for n, _c in columns], row_name))
    return found


# Autograd nodes that must not lie between a column and a row layer: they mix features (norms,
# reductions, other matrix products), so the split would not commute with them.
_NOT_FEATURE_LOCAL = ("NativeLayerNormBackward", "NativeGroupNormBackward",
                      "NativeBatchNormBackward", "CudnnBatchNormBackward", "LinalgVectorNorm",
                      "NormBackward", "RmsNormBackward", "FusedRmsNormBackward", "MeanBackward",
                      "SumBackward", "LogSoftmaxBackward", "AddmmBackward", "MmBackward",
                      "LinearBackward")


_UNPAIRED = ("Set parallel.tensor_pairs = false (parallelize_tensor(..., pairs=False)): each "
             "Linear is then split on its own, its output gathered.")


class PairCheck:
    """Checks, on the first forward with autograd on, that a pair's row layer reads what its
    column layers wrote (see find_pairs), by walking the autograd graph back from the row's
    input to the columns' outputs; then removes its hooks."""

    def __init__(self, name: str, parent: nn.Module, columns: list[nn.Module], row: nn.Module,
                 col_names: list[str], row_name: str):
        self.name, self.col_names, self.row_name = name or "<root>", col_names, row_name
        self.inputs: set = set()
        self.outputs: set = set()
        self.handles = [parent.register_forward_pre_hook(self._parent_input)]
        self.handles += [c.register_forward_hook(self._column_output) for c in columns]
        self.handles.append(row.register_forward_pre_hook(self._row_input))

    def _parent_input(self, _module, args):
        self.inputs = {a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn}
        self.outputs = set()

    def _column_output(self, _module, _args, out):
        if out.grad_fn is not None:
            self.outputs.add(out.grad_fn)

    def _row_input(self, _module, args):
        x = args[0]
        if not self.outputs:
            return None                      # no graph to check (no grad): try the next forward
        where = f"{self.name}: row layer {self.row_name!r} after column layer(s) {self.col_names}"
        if x.grad_fn is None:
            raise TensorSplitError(
                f"{where}: the row layer's input is not computed from the column "
                "layers' outputs, so they cannot be split as a column → row pair. "
                + _UNPAIRED)
        seen, stack, reached = set(), [x.grad_fn], False
        while stack and len(seen) < 100_000:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in self.outputs:
                reached = True
                continue
            if node in self.inputs:
                raise TensorSplitError(
                    f"{where}: the row layer's input depends on the module's input "
                    "other than through the column layers, so they cannot be split "
                    "as a column → row pair. " + _UNPAIRED)
            kind = type(node).__name__
            if kind.startswith(_NOT_FEATURE_LOCAL):
                raise TensorSplitError(
                    f"{where}: between them the model applies {kind}, which mixes "
                    "features, so they cannot be split as a column → row pair. "
                    + _UNPAIRED)
            stack.extend(n for n, _ in node.next_functions)
        if not reached:
            raise TensorSplitError(
                f"{where}: the row layer's input is not computed from the column "
                "layers' outputs, so they cannot be split as a column → row pair. "
                + _UNPAIRED)
        for handle in self.handles:
            handle.remove()
        return None
