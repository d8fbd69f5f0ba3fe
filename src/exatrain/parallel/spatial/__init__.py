"""Spatial parallelism (the `space` axis): distributed convolutions with halo exchange.

  convert.py     parallelize_spatial: swap the layers that see split tensors; describe_spatial
  runtime.py     SpatialRuntime: what the layers of one model share; the model-boundary hooks
  blocks.py      where each rank's block lies: block regions, SpatialBlocks, split_input,
                 gather_output, pipeline stages' split regions
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

from .blocks import (SpatialBlocks, block_region, block_shape, block_slices, gather_output,
                     is_transition, split_input, stage_regions, whole_shape)
from .convert import describe_spatial, parallelize_spatial
from .runtime import SpatialRuntime
from ...errors import SpatialSplitError

__all__ = ["SpatialBlocks", "SpatialRuntime", "SpatialSplitError", "block_region", "block_shape",
           "block_slices", "describe_spatial", "gather_output", "is_transition",
           "parallelize_spatial", "split_input", "stage_regions", "whole_shape"]
