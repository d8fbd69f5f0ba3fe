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
after checking the module's `forward` source for the spellings that cannot work on a rank's
share of the heads: a size computed by dividing by the head count (`C // self.n_head`, where `C`
is the full width read from the input), and a reshape to a full width attribute
(`view(B, T, self.hidden_size)`). Those are refused when the model is parallelized, before any
training step, with the module, the attribute and the rewrite that works. (Without source, e.g.
a compiled class, only the attributes are set.) No communication.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

from torch import nn

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


def _refusal(name: str, module: nn.Module, attr: str, found: str, split: int, axis: str,
             fix: str) -> ValueError:
    heads = max(head_count_attrs(module).values(), default=0)
    return ValueError(
        f"tensor parallelism splits attention module {name!r} ({type(module).__name__}) by "
        f"heads: with {axis}={split} each rank holds {heads // split} of its {heads} heads, and "
        f"exatrain sets its head-count attributes to the local count. But its forward uses "
        f"`{found}`, which then computes the wrong size. Fix: {fix} (the code then runs "
        f"unchanged serially), or split its Linears one at a time (more communication) with "
        f"parallelize_tensor(..., pairs=False).")


def check_forward(name: str, module: nn.Module, split: int, axis: str) -> None:
    """Refuse (ValueError naming module, attribute and fix) a forward that cannot run on a
    rank's share of the heads; see the module docstring for the spellings."""
    source = _forward_source(module)
    if source is None:
        return
    for attr in head_count_attrs(module):
        match = re.search(rf"[\w\.\)\]]+\s*//?\s*self\.{attr}\b", source)
        if match:
            raise _refusal(name, module, attr, match.group(0), split, axis,
                           f"compute the per-head size once in __init__ (self.head_dim = "
                           f"n_embd // {attr}) and reshape with view(B, T, self.{attr}, "
                           f"self.head_dim) or view(B, T, -1, self.head_dim)")
    for attr in WIDTH_ATTRS:
        match = re.search(rf"\.(?:view|reshape)\([^()]*self\.{attr}\b[^()]*\)", source)
        if match:
            raise _refusal(name, module, attr, match.group(0), split, axis,
                           f"reshape the attention output with view(B, T, -1) instead of "
                           f"self.{attr}, so that it holds this rank's heads")


def localize_heads(name: str, module: nn.Module, split: int, axis: str) -> dict[str, int]:
    """Check `module`'s forward, then set its head-count attributes to heads // split.

    Returns {attribute: local count}. A head count that `split` does not divide is refused.
    """
    if split == 1:
        return {}
    check_forward(name, module, split, axis)
    local = {}
    for attr, heads in head_count_attrs(module).items():
        if heads % split:
            raise ValueError(
                f"attention module {name!r} ({type(module).__name__}) has self.{attr}={heads} "
                f"heads, which {axis}={split} does not divide: choose a tensor degree that "
                f"divides {heads}.")
        local[attr] = heads // split
        setattr(module, attr, heads // split)
    return local


__all__ = ["HEAD_COUNT_ATTRS", "check_forward", "head_count_attrs", "localize_heads"]
