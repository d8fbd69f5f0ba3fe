"""Where each rank's spatial block lies, and the helpers that cut, read and gather blocks:
a sample's block (`block_region`, `block_slices`), a data set read by blocks (`SpatialBlocks`),
a whole batch cut into this rank's block and a split output gathered whole (`split_input`,
`gather_output`, differentiable), and the split and whole regions of pipeline stages.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

from ...errors import SpatialSplitError
from ...mesh import Mesh
from .functions import GatherBlocks, SplitBlocks

# the global pools that end the split region when they pool to one cell
GLOBAL_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)


# ------------------------------------------------------------------------- pipeline stages
def is_transition(module: nn.Module) -> bool:
    """Does `module` end the split region (gather or reduce the blocks)?"""
    if type(module) is nn.Flatten:
        return True
    size = getattr(module, "output_size", None)
    return isinstance(module, GLOBAL_POOLS) and all(
        s == 1 for s in (size if isinstance(size, tuple) else (size,)))


def stage_regions(stages: list[nn.Module]) -> list[tuple[bool, bool]]:
    """(input split?, output split?) of each pipeline stage, in order: tensors are split into
    blocks from the model's input up to the first stage holding a transition layer."""
    regions, split = [], True
    for stage in stages:
        after = split and not any(is_transition(m) for m in stage.modules())
        regions.append((split, after))
        split = after
    return regions


def whole_shape(shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    """The whole (N, C, *spatial) shape whose blocks have `shape`."""
    k = len(shape) - 2
    parts = tuple(mesh.plan.space)[3 - k:]
    return tuple(shape[:2]) + tuple(n * p for n, p in zip(shape[2:], parts))


def block_shape(shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    """This rank's block of a whole (N, C, *spatial) shape (equal blocks)."""
    region = block_region(tuple(shape[2:]), mesh)
    return tuple(shape[:2]) + tuple(r.stop - r.start for r in region)


# ------------------------------------------------------------------------- data layout
def block_region(sample_shape: tuple[int, ...], mesh: Mesh) -> tuple[slice, ...]:
    """This rank's block of a sample with spatial shape `sample_shape` ((d, h, w), (h, w) or (w,)).

    Blocks are equal: each spatial size must be divisible by its degree.
    """
    return block_slices(sample_shape, tuple(mesh.plan.space),
                        tuple(mesh.coords[f"space_{a}"] for a in "dhw"))


def own_dims(space: tuple[int, int, int], k: int) -> tuple[int, int, int]:
    """`space` (d, h, w) with the degrees of the dims a k-D sample lacks moved onto its first own
    dim: the split a k-D model can take on the same ranks ((2, 1, 1), k=2 -> (1, 2, 1))."""
    if not 1 <= k <= 3:
        return tuple(space)
    lost = math.prod(space[:3 - k])
    return (1,) * (3 - k) + (lost * space[3 - k],) + tuple(space[4 - k:])


def block_slices(sample_shape: tuple[int, ...], space: tuple[int, int, int],
                 coords: tuple[int, int, int]) -> tuple[slice, ...]:
    """The block at grid `coords` (d, h, w) of a sample split by `space` (d, h, w)."""
    k = len(sample_shape)
    parts = tuple(space)
    if any(p > 1 for p in parts[:3 - k]):
        raise SpatialSplitError(f"samples of spatial shape {tuple(sample_shape)} have {k} spatial "
                                f"dims but the plan splits space={parts} (d, h, w); use "
                                f"space={own_dims(parts, k)} on as many ranks.")
    region = []
    for n, p, c, a in zip(sample_shape, parts[3 - k:], coords[3 - k:], "dhw"[3 - k:]):
        if n % p:
            ok = [q for q in range(1, min(n, 64) + 1) if n % q == 0]
            raise SpatialSplitError(f"the samples are {n} long along {a}, which space_{a}={p} does "
                                    f"not divide into equal blocks; use one of {ok}.")
        region.append(slice(c * n // p, (c + 1) * n // p))
    return tuple(region)


class SpatialBlocks(Dataset):
    """A data set whose samples are this rank's spatial block of the samples of `dataset`.

    Each item is `dataset.read(index, region)`: an HDF5 hyperslab read of the block only, never
    the whole sample. `bytes_read` is the underlying data set's counter (bytes this process read).
    """

    def __init__(self, dataset, region: tuple[slice, ...]):
        if not hasattr(dataset, "read"):
            raise TypeError(f"{type(dataset).__name__} has no read(index, region) method; spatial "
                            "parallelism needs a data set that can read a block of a sample.")
        self.dataset, self.region = dataset, tuple(region)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset.read(index, self.region)

    def __getitems__(self, indices: list[int]):
        """A batch of blocks, read straight into one buffer where the data set can (raw counts)."""
        if hasattr(self.dataset, "read_batch"):
            return self.dataset.read_batch(indices, self.region)
        return [self.dataset.read(i, self.region) for i in indices]

    @property
    def bytes_read(self) -> int:
        return self.dataset.bytes_read

    @property
    def read_counter(self):
        """The underlying data set's `data.reads.ReadCounter`, if it keeps one."""
        return getattr(self.dataset, "read_counter", None)

    def targets(self):
        return self.dataset.targets()


def split_input(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's block of a whole batch (N, C, *spatial); differentiable (backward all-gathers)."""
    k = x.dim() - 2
    parts = tuple(mesh.plan.space)[3 - k:]
    coords = tuple(mesh.coords[f"space_{a}"] for a in "dhw"[3 - k:])
    block_region(tuple(x.shape[2:]), mesh)  # the same checks and messages
    return SplitBlocks.apply(x, mesh.axis("space"), parts, coords)


def gather_output(y: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The whole tensor from the blocks of a split output (N, C, *spatial), on every rank."""
    k = y.dim() - 2
    parts = tuple(mesh.plan.space)[3 - k:]
    coords = tuple(mesh.coords[f"space_{a}"] for a in "dhw"[3 - k:])
    return GatherBlocks.apply(y, mesh.axis("space"), parts, coords)
