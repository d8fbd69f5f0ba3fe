"""Tensor parallelism (the `tensor` axis): 1D (Megatron) and 3D (AxoNN) parallel matrix multiply,
and channel/filter parallelism of convolutions (LBANN, SC19).

  convert.py     parallelize_tensor: find column/row pairs, swap Linears, wire gradient sync
  linear1d.py    column- and row-parallel Linear layers
  linear3d.py    the 3D parallel matrix multiply over the (x, y, z) grid
  conv.py        channel- and filter-parallel convolutions (Conv1d/2d/3d, ConvTranspose1d/2d/3d)
  cnn.py         which convolutions split: filter → channel pairs in nn.Sequential, singles
  switch.py      where a CNN switches from `space` to channel/filter under Plan(space, tensor)
  state.py       full-weight load/save and DTensor views for checkpoints
"""

from .convert import TensorParallel, clone_tree, find_pairs, parallelize_tensor
from .state import (dtensor_state_dict, for_checkpoint, full_state_dict, gather_full, layout_of,
                    load_full_state_dict)

__all__ = ["TensorParallel", "clone_tree", "dtensor_state_dict", "find_pairs", "for_checkpoint",
           "full_state_dict", "gather_full", "layout_of", "load_full_state_dict", "parallelize_tensor"]
