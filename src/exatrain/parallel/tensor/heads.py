"""Attention modules written the usual ways, split by heads under `tensor`.

When easy mode splits an attention module's q/k/v → out Linears as a column → row pair, each rank
holds `heads / split` whole heads (split = tensor for 1D, tensor_x for 3D): its q, k, v have
`local_heads * head_dim` features. Model code reshapes with its own attributes, in one of a few
common spellings:

    nanoGPT      self.n_head               q.view(B, T, self.n_head, C // self.n_head)
    HF           self.num_heads, head_dim  q.view(B, T, self.num_heads, self.head_dim)
    torchtitan   self.n_heads, head_dim    xq.view(bs, seqlen, -1, self.head_dim)

`localize_heads` sets every head-count attribute of a split module to the local head count (so
`view(B, T, self.num_heads, self.head_dim)` and `view(B, T, -1, self.head_dim)` work unchanged),
after checking that the module's `forward` runs on a rank's share of the heads. The check runs
it: a copy of the module on the meta device (no memory, no arithmetic), with its split Linears at
their local widths and its head counts local, is called on a (2, 4, width) input next to an
unsplit copy. A forward that fails there, or returns another shape, cannot run on a share of the
heads, whatever its source says; one that runs is accepted, even if its source holds an
expression such as `C // self.n_head` in a branch it does not take. The spellings that fail are
a size computed by dividing by the head count (`C // self.n_head`, where `C` is the full width
read from the input) and a reshape to a full width attribute (`view(B, T, self.hidden_size)`);
they are refused when the model is parallelized, before any training step, with the module, the
attribute and the rewrite that works (found in the source, for the message only). A forward that
cannot be run even unsplit on such an input (it needs more arguments, e.g. rotary frequencies)
is judged from its source instead. No communication.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import textwrap

import torch
from torch import nn

from ...errors import TensorSplitError

# Attributes that hold a module's number of attention heads (query heads, and key/value heads:
# in a split pair all projections have one width, so there are as many kv heads as q heads).
HEAD_COUNT_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads",
                    "num_key_value_heads")
# Attributes that hold the module's full model width (heads × head_dim).
WIDTH_ATTRS = ("n_embd", "embed_dim", "hidden_size", "d_model", "all_head_size")


def head_count_attrs(module: nn.Module) -> dict[str, int]:
    """The module's head-count attributes that are positive ints: {name: value}."""
    out = {}
    for name in HEAD_COUNT_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = value
    return out


def _forward_source(module: nn.Module) -> str | None:
    """The code of `type(module).forward`, without comments and docstrings (so that prose
    mentioning `C // self.n_head` is not taken for code); None when it cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _refusal(name: str, module: nn.Module, found: str, split: int, axis: str,
             fix: str) -> TensorSplitError:
    heads = max(head_count_attrs(module).values(), default=0)
    return TensorSplitError(
        f"tensor parallelism splits attention module {name!r} ({type(module).__name__}) by "
        f"heads: with {axis}={split} each rank holds {heads // split} of its {heads} heads, and "
        f"exatrain sets its head-count attributes to the local count. But its forward uses "
        f"{found}, which then computes the wrong size. Fix: {fix} (the code then runs "
        f"unchanged serially), or split its Linears one at a time (more communication) with "
        f"parallelize_tensor(..., pairs=False).")


def _spelling(module: nn.Module, source: str | None) -> tuple[str, str] | None:
    """The spelling in `source` that cannot run on a share of the heads, as (what, fix)."""
    if source is None:
        return None
    for attr in head_count_attrs(module):
        match = re.search(rf"[\w\.\)\]]+\s*//?\s*self\.{attr}\b", source)
        if match:
            return (f"`{match.group(0)}`",
                    f"compute the per-head size once in __init__ (self.head_dim = "
                    f"n_embd // {attr}) and reshape with view(B, T, self.{attr}, "
                    f"self.head_dim) or view(B, T, -1, self.head_dim)")
    for attr in WIDTH_ATTRS:
        match = re.search(rf"\.(?:view|reshape)\([^()]*self\.{attr}\b[^()]*\)", source)
        if match:
            return (f"`{match.group(0)}`",
                    f"reshape the attention output with view(B, T, -1) instead of "
                    f"self.{attr}, so that it holds this rank's heads")
    return None


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers live on the meta device (no data)."""
    memo = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _run_on_meta(module: nn.Module, width: int):
    """The output shape of `module` on a meta (2, 4, width) input, or the exception it raised."""
    try:
        with torch.no_grad():
            out = module(torch.empty(2, 4, width, device="meta"))
        return tuple(out.shape) if isinstance(out, torch.Tensor) else None
    except Exception as exc:  # what the forward does on these shapes is the question asked
        return exc


def runs_on_local_heads(module: nn.Module, split: int, cols: list[str], row: str):
    """Run `module` on the meta device unsplit and with this rank's share of the heads.

    Returns None when the split forward gives the unsplit output's shape, the exception (or
    the wrong shape) when it does not, and "unknown" when the unsplit forward itself does not
    run on a (2, 4, width) input (then nothing is learned from running it)."""
    width = getattr(module, cols[0]).in_features
    full = _run_on_meta(_meta_copy(module), width)
    if isinstance(full, Exception) or full is None:
        return "unknown"
    local = _meta_copy(module)
    for n in cols:
        c = getattr(local, n)
        setattr(local, n, nn.Linear(c.in_features, c.out_features // split,
                                    bias=c.bias is not None, device="meta"))
    r = getattr(local, row)
    setattr(local, row, nn.Linear(r.in_features // split, r.out_features,
                                  bias=r.bias is not None, device="meta"))
    for attr, heads in head_count_attrs(local).items():
        setattr(local, attr, heads // split)
    got = _run_on_meta(local, width)
    if got == full:
        return None
    return got if isinstance(got, Exception) else ValueError(f"output shape {got}, not {full}")


def check_forward(name: str, module: nn.Module, split: int, axis: str,
                  cols: list[str] | None = None, row: str | None = None) -> None:
    """Refuse (ValueError naming module, attribute and fix) a forward that cannot run on a
    rank's share of the heads: decided by running it on the meta device when the split
    Linears `cols` (column) and `row` are named, else from its source (module docstring)."""
    source = _forward_source(module)
    verdict = runs_on_local_heads(module, split, cols, row) if cols and row else "unknown"
    if verdict is None:
        return
    spelling = _spelling(module, source)
    if verdict == "unknown":
        if spelling is not None:
            raise _refusal(name, module, *spelling, split, axis)
        return
    what, fix = spelling or (
        "a size that does not hold on a rank's share of the heads",
        "reshape with the per-head size (view(B, T, -1, self.head_dim)) and the output with "
        "view(B, T, -1)")
    raise _refusal(name, module, f"{what} (run on the meta device with this rank's share of the "
                   f"heads, it fails: {type(verdict).__name__}: {str(verdict).splitlines()[0][:200]})",
                   split, axis, fix)


def localize_heads(name: str, module: nn.Module, split: int, axis: str,
                   cols: list[str] | None = None, row: str | None = None) -> dict[str, int]:
    """Check `module`'s forward, then set its head-count attributes to heads // split.

    Returns {attribute: local count}. A head count that `split` does not divide is refused.
    """
    if split == 1:
        return {}
    check_forward(name, module, split, axis, cols, row)
    local = {}
    for attr, heads in head_count_attrs(module).items():
        if heads % split:
            raise TensorSplitError(
                f"attention module {name!r} ({type(module).__name__}) has self.{attr}={heads} "
                f"heads, which {axis}={split} does not divide: choose a tensor degree that "
                f"divides {heads}.")
        local[attr] = heads // split
        setattr(module, attr, heads // split)
    return local


__all__ = ["HEAD_COUNT_ATTRS", "check_forward", "head_count_attrs", "localize_heads",
           "runs_on_local_heads"]
