"""Spatial parallelism (the `space` axis): distributed convolutions with halo exchange.

  convert.py     parallelize_spatial: swap the layers that see split tensors; block reading helpers
  layers.py      the base of the distributed layers (split / gather / replicated) and halo geometry
  conv.py        convolutions and transposed convolutions (halo exchange, optional overlap)
  pool.py        window pools, the image-pool branch, and the transitions (flatten, global pools)
  norm.py        BatchNorm, GroupNorm / InstanceNorm, LayerNorm / RMSNorm
  interpolate.py upsampling: nearest (block-local) and linear/bilinear/trilinear (one-cell halo)
  dropout.py     dropout with masks distributed as a serial mask
  functions.py   autograd Functions: split/gather blocks, BatchNorm statistics, shared masks
  guard.py       refuses arithmetic in a user's forward that would read a block as the whole sample
  volume.py      the halo volume a split model moves (the formula bench and planner check)

Imports: comm, mesh, errors, models (the ImagePool type), parallel.batchnorm; nothing above
parallel (tests/test_import_graph.py).
"""

from .convert import (SpatialBlocks, SpatialRuntime, block_region, block_shape, block_slices,
                      describe_spatial, gather_output, is_transition, parallelize_spatial,
                      split_input, stage_regions, whole_shape)
from ...errors import SpatialSplitError

__all__ = ["SpatialBlocks", "SpatialRuntime", "SpatialSplitError", "block_region", "block_shape",
           "block_slices", "describe_spatial", "gather_output", "is_transition",
           "parallelize_spatial", "split_input", "stage_regions", "whole_shape"]
