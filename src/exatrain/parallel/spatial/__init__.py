"""Spatial parallelism (the `space` axis): distributed convolutions with halo exchange.

  convert.py     parallelize_spatial: swap the layers that see split tensors; block reading helpers
  layers.py      the distributed layers (conv, pooling, norms, transitions) and their halo geometry
  interpolate.py linear/bilinear/trilinear upsampling at global source positions (one-cell halo)
  functions.py   autograd Functions: split/gather blocks, BatchNorm statistics, shared masks
"""

from .convert import (SpatialBlocks, SpatialRuntime, block_region, block_shape, block_slices,
                      describe_spatial, gather_output, is_transition, parallelize_spatial,
                      split_input, stage_regions, whole_shape)
from .layers import SpatialSplitError

__all__ = ["SpatialBlocks", "SpatialRuntime", "SpatialSplitError", "block_region", "block_shape",
           "block_slices", "describe_spatial", "gather_output", "is_transition",
           "parallelize_spatial", "split_input", "stage_regions", "whole_shape"]
