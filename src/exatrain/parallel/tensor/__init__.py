"""Tensor parallelism (the `tensor` axis): 1D (Megatron) and 3D (AxoNN) parallel matrix multiply,
and channel/filter parallelism of convolutions (LBANN, SC19).

  convert.py     parallelize_tensor: swap Linears and convolutions, the model's boundary
                 (dropout seeds, the batch over tensor_z), gradient sync
  sequence.py    sequence parallelism between the pairs of a list of blocks (1D)
  pairs.py       which Linears chain as column → row pairs, checked on the first forward
  tree.py        the converted tree: a storage-sharing copy, tied parameters, meta materialisation
  linear1d.py    column- and row-parallel Linear layers
  linear3d.py    the 3D parallel matrix multiply over the (x, y, z) grid
  conv.py        channel- and filter-parallel convolutions (Conv1d/2d/3d, ConvTranspose1d/2d/3d)
  cnn.py         which convolutions split: filter → channel pairs in nn.Sequential, singles
  switch.py      where a CNN switches from `space` to channel/filter under Plan(space, tensor),
                 and which convolutions split (conv_selection)
  state.py       full-weight load/save and DTensor views for checkpoints
  heads.py       a split attention module's local head counts, or a refusal
  rng.py         the random stream of a training forward, apart from the user's

Imports: comm, mesh, errors, and parallel's own modules (gradsync, options, memory); nothing
above parallel (tests/test_import_graph.py).
"""

from .convert import TensorParallel, parallelize_tensor
from .pairs import find_pairs
from .state import (dtensor_state_dict, for_checkpoint, full_state_dict, gather_full, layout_of,
                    load_full_state_dict)
from .tree import clone_tree

__all__ = ["TensorParallel", "clone_tree", "dtensor_state_dict", "find_pairs", "for_checkpoint",
           "full_state_dict", "gather_full", "layout_of", "load_full_state_dict", "parallelize_tensor"]
