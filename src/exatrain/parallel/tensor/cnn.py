"""Which convolutions of a CNN split over `tensor`, and how: filter → channel pairs, gathered singles.

`split_convolutions(root, axis, eligible)` swaps, in place, the convolutions of `root` (see conv.py):

  pairs     inside one nn.Sequential (nested nn.Sequentials flattened, exact type, so the data
            flow is the Sequential's own: each child reads what the previous one wrote), a
            convolution followed by per-channel layers only (BatchNorm, pointwise activations,
            pooling, dropout, nearest upsampling, Identity) and then another convolution become
            a filter-parallel → channel-parallel pair: nothing moves between them, the
            BatchNorms between hold the local channels (`split_batchnorm`). Pairs do not overlap.
  singles   every other eligible convolution whose filters divide the axis becomes a
            filter-parallel convolution that all-gathers its output channels, so what leaves it
            is whole: residual additions, concatenations (torch.cat in a forward) and anything
            else outside a pair see whole tensors on every rank.
  whole     grouped / depthwise convolutions, convolutions whose channels do not divide the axis,
            tied or shared ones, and those `eligible` rejects (they run before the switch point
            under `space`, or `parallel.chanfilt_skip` names them) stay whole.

A split tensor never leaves a pair, so there is nothing across a split for a residual or a
concatenation to meet. Subclasses of the conv types (a parametrized conv: weight or spectral
norm) are not split: they stay whole. Refused before training, with the module's name
(`refusal`): names in `parallel.chanfilt_from` / `parallel.chanfilt_skip` that are no
convolution of the model. Under the 3D grid (tensor=(x, y, z)) convolutions stay whole.
"""

from __future__ import annotations

from torch import nn

from ...comm import Axis
from .conv import ChannelParallelConv, FilterParallelConv, is_conv, split_batchnorm, splittable

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
PER_CHANNEL = BATCHNORMS + (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus)


def _per_channel(module: nn.Module) -> bool:
    if type(module) is nn.Upsample:
        return module.mode == "nearest"
    return type(module) in PER_CHANNEL


def sequential_chains(root: nn.Module) -> list[list[tuple[str, nn.Module, str, nn.Module]]]:
    """The leaf chains of every outermost nn.Sequential: [(name, parent, key, module), ...] in
    execution order; a child that is not an nn.Sequential is one element of its chain."""
    inner = {id(c) for m in root.modules() if type(m) is nn.Sequential
             for c in m.children() if type(c) is nn.Sequential}
    chains = []
    for name, seq in root.named_modules():
        if type(seq) is not nn.Sequential or id(seq) in inner:
            continue
        chain: list = []

        def walk(s: nn.Sequential, prefix: str) -> None:
            for key, child in s.named_children():
                if type(child) is nn.Sequential:
                    walk(child, f"{prefix}{key}.")
                else:
                    chain.append((f"{prefix}{key}", s, key, child))
        walk(seq, f"{name}." if name else "")
        chains.append(chain)
    return chains


def find_conv_pairs(root: nn.Module, size: int, eligible) -> list[tuple[tuple, list, tuple]]:
    """(filter conv entry, per-channel entries between, channel conv entry) per pair."""
    pairs = []
    for chain in sequential_chains(root):
        i = 0
        while i < len(chain):
            name, _p, _k, module = chain[i]
            if not (is_conv(module) and eligible(name) and splittable(module, size, "filter")):
                i += 1
                continue
            j = i + 1
            while j < len(chain) and _per_channel(chain[j][3]):
                j += 1
            if j < len(chain) and is_conv(chain[j][3]) and eligible(chain[j][0]) and \
                    splittable(chain[j][3], size, "channel") and \
                    type(chain[j][3]).__name__[-2:] == type(module).__name__[-2:] and \
                    all(not isinstance(m, BATCHNORMS) or m.num_features % size == 0
                        for _n, _p2, _k2, m in chain[i + 1:j]):
                pairs.append((chain[i], chain[i + 1:j], chain[j]))
                i = j + 1
            else:
                i += 1
    return pairs


def refusal(root: nn.Module, convs_from: str, skip: list[str]) -> str | None:
    """Why the convolutions of `root` cannot be split as configured (with the fix), or None."""
    convs = [n for n, m in root.named_modules() if is_conv(m)]
    for name in ([convs_from] if convs_from else []) + list(skip):
        if name not in convs:
            return (f"parallel.chanfilt: {name!r} is no convolution of the model "
                    f"(its convolutions: {convs[:12]}{'...' if len(convs) > 12 else ''}); "
                    "name one of those.")
    return None


def split_convolutions(root: nn.Module, axis: Axis, eligible, tied: set[int]) -> dict:
    """Swap the convolutions of `root` in place (module docstring). Returns what was done:
    {"pairs": [(filter name, channel name)], "gathered": [names], "whole": [names],
     "layers": [the new conv modules], "batchnorms": [names of split BatchNorms]}."""
    counts: dict[int, int] = {}
    for m in root.modules():
        counts[id(m)] = counts.get(id(m), 0)
    for _n, m in root.named_modules(remove_duplicate=False):
        counts[id(m)] += 1
    ok = (lambda name, m: eligible(name) and counts[id(m)] == 1
          and not any(id(p) in tied for p in m.parameters()))
    done = {"pairs": [], "gathered": [], "whole": [], "layers": [], "batchnorms": []}
    seen: set[int] = set()
    for first, between, second in find_conv_pairs(root, axis.size, eligible):
        if not (ok(first[0], first[3]) and ok(second[0], second[3])):
            continue
        f = FilterParallelConv(first[3], axis)
        c = ChannelParallelConv(second[3], axis)
        setattr(first[1], first[2], f)
        setattr(second[1], second[2], c)
        for name, parent, key, m in between:
            if isinstance(m, BATCHNORMS):
                setattr(parent, key, split_batchnorm(m, axis))
                done["batchnorms"].append(name)
        seen |= {id(first[3]), id(second[3])}
        done["pairs"].append((first[0], second[0]))
        done["layers"] += [f, c]
    for name, module in list(root.named_modules()):
        for key, child in list(module.named_children()):
            if not is_conv(child) or id(child) in seen:
                continue
            full = f"{name}.{key}" if name else key
            seen.add(id(child))
            if ok(full, child) and splittable(child, axis.size, "filter"):
                layer = FilterParallelConv(child, axis, gather_output=True)
                setattr(module, key, layer)
                done["gathered"].append(full)
                done["layers"].append(layer)
            else:
                done["whole"].append(full)
    return done


__all__ = ["PER_CHANNEL", "find_conv_pairs", "refusal", "sequential_chains", "split_convolutions"]
