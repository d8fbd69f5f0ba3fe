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
it: a copy of the module with its split Linears at their local widths and its head counts local
is called on a (2, 4, width) input next to an unsplit copy. A forward that fails there, or
returns another shape, cannot run on a share of the heads, whatever its source says; one that
runs is accepted, even if its source holds an expression such as `C // self.n_head` in a branch
it does not take. The copies live on the meta device first (no memory, no arithmetic); a forward
that makes a tensor of its own without `device=` (a causal mask `torch.ones(t, t).tril()`, as
most hand-written attention does) cannot mix it with meta tensors, so when the unsplit copy
fails there the pair is run again on real zero-filled tensors of the module's device (the CPU
for a model still on meta), under `no_grad`, with the random state restored afterwards. The
spellings that fail are a size computed by dividing by the head count (`C // self.n_head`,
where `C` is the full width read from the input) and a reshape to a full width attribute
(`view(B, T, self.hidden_size)`); they are refused when the model is parallelized, before any
training step, with the module, the attribute and the rewrite that works (found in the source,
for the message only). A forward that cannot be run even unsplit on such an input (it needs more
arguments, e.g. rotary frequencies) is judged from its source instead. No communication.
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


def _refusal(name: str, module: nn.Module, *, found: str, fix: str, split: int,
             axis: str) -> TensorSplitError:
    # keyword-only: `found` and `fix` are both text and `split` a number, so a positional call
    # with them out of order failed inside the message (`heads // "..."`), not as a refusal
    heads = max(head_count_attrs(module).values(), default=0)
    return TensorSplitError(
        f"tensor parallelism splits attention module {name!r} ({type(module).__name__}) by "
        f"heads: with {axis}={split} each rank holds {heads // split} of its {heads} heads, and "
        f"exatrain sets its head-count attributes to the local count. But its forward uses "
        f"{found}, which then computes the wrong size. Fix: {fix} (the code then runs "
        f"unchanged serially), or split its Linears one at a time (more communication) with "
        f"parallel.tensor_pairs = false (parallelize_tensor(..., pairs=False)).")


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


def _probe_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of `module` for a trial forward on `device`: on meta, parameters and buffers
    without data; elsewhere, parameters zero-filled (the trial asks for shapes only, and zeros
    keep it deterministic) and buffers copied, since a forward may read them (a causal mask)."""
    memo = {}
    for t in module.parameters():
        new = torch.zeros(t.shape, dtype=t.dtype, device=device) if device.type != "meta" \
            else torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(new, t.requires_grad)
    for t in module.buffers():
        memo[id(t)] = torch.empty_like(t, device="meta") if device.type == "meta" \
            else t.detach().to(device, copy=True)
    return copy.deepcopy(module, memo)


def _run(module: nn.Module, width: int, dtype: torch.dtype, device: torch.device):
    """The output shape of `module` on a (2, 4, width) input on `device`, or the exception it
    raised."""
    # a trial forward draws dropout masks from the user's generators: hand their state back
    cuda = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            out = module(torch.zeros(2, 4, width, dtype=dtype, device=device))
        return tuple(out.shape) if isinstance(out, torch.Tensor) else None
    except Exception as exc:  # what the forward does on these shapes is the question asked
        return exc


def _trial_linear(like: nn.Linear, in_features: int, out_features: int,
                  device: torch.device) -> nn.Linear:
    """A Linear of `like`'s kind at the given widths, zero-filled on `device`: built on meta
    first, since nn.Linear's own initialisation draws from the user's random stream."""
    linear = nn.Linear(in_features, out_features, bias=like.bias is not None, device="meta",
                       dtype=like.weight.dtype)
    if device.type != "meta":
        linear = linear.to_empty(device=device)
        with torch.no_grad():
            for p in linear.parameters():
                p.zero_()
    return linear


def _local_copy(module: nn.Module, split: int, cols: list[str], row: str,
                device: torch.device) -> nn.Module:
    """A trial copy with this rank's share of the heads: the column Linears `cols` and the row
    Linear `row` at their local widths, the head counts local."""
    local = _probe_copy(module, device)
    for n in cols:
        c = getattr(local, n)
        setattr(local, n, _trial_linear(c, c.in_features, c.out_features // split, device))
    r = getattr(local, row)
    setattr(local, row, _trial_linear(r, r.in_features // split, r.out_features, device))
    for attr, heads in head_count_attrs(local).items():
        setattr(local, attr, heads // split)
    return local


def runs_on_local_heads(module: nn.Module, split: int, cols: list[str], row: str):
    """Run `module` unsplit and with this rank's share of the heads, on the meta device, or
    where the unsplit forward fails there, on real tensors of the module's device.

    Returns None when the split forward gives the unsplit output's shape, the exception (or
    the wrong shape) when it does not, and "unknown" when the unsplit forward itself does not
    run on a (2, 4, width) input (then nothing is learned from running it)."""
    weight = getattr(module, cols[0]).weight
    width, dtype = weight.shape[1], weight.dtype
    own = weight.device if weight.device.type != "meta" else torch.device("cpu")
    for device in (torch.device("meta"), own):
        full = _run(_probe_copy(module, device), width, dtype, device)
        if isinstance(full, Exception) or full is None:
            continue  # e.g. a device-less tensor made in the forward met meta ones: run for real
        got = _run(_local_copy(module, split, cols, row, device), width, dtype, device)
        if got == full:
            return None
        return got if isinstance(got, Exception) else ValueError(
            f"output shape {got}, not {full}")
    return "unknown"


def check_forward(name: str, module: nn.Module, split: int, axis: str,
                  cols: list[str] | None = None, row: str | None = None) -> None:
    """Refuse (TensorSplitError naming module, attribute and fix) a forward that cannot run on
    a rank's share of the heads: decided by running it (`runs_on_local_heads`) when the split
    Linears `cols` (column) and `row` are named, else from its source (module docstring)."""
    source = _forward_source(module)
    verdict = runs_on_local_heads(module, split, cols, row) if cols and row else "unknown"
    if verdict is None:
        return
    spelling = _spelling(module, source)
    if verdict == "unknown":
        if spelling is not None:
            what, fix = spelling
            raise _refusal(name, module, found=what, fix=fix, split=split, axis=axis)
        return
    what, fix = spelling or (
        "a size that does not hold on a rank's share of the heads",
        "reshape with the per-head size (view(B, T, -1, self.head_dim)) and the output with "
        "view(B, T, -1)")
    raise _refusal(name, module, fix=fix, split=split, axis=axis,
                   found=f"{what} (run with this rank's share of the heads, it fails: "
                         f"{type(verdict).__name__}: {str(verdict).splitlines()[0][:200]})")


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
