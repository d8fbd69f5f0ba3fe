"""Refuse, by name, the operations written in a user's `forward` that would see a block as if it
were the whole sample.

On whole samples (`parallelize(..., whole_samples=True)`: a user's own model and data set), each
rank runs the model's forward on its block of every sample. exatrain's spatial layers (the
modules `convert.py` swapped in: convolutions with halos, norms with global statistics, pools,
upsampling) make their modules equal to one process. What they cannot see is arithmetic written
in `forward` itself: `F.conv3d(x, w)`, `F.interpolate(x, ...)`, `F.pad`, `F.max_pool3d`,
`torch.roll`, `x.flip(2)`, or a reduction over the spatial dims that keeps them
(`x - x.mean(dim=(2, 3, 4), keepdim=True)`). On a block those read no halo and reduce over a part
of the sample, so the model would train differently from one process without a word.

`BlockMixingGuard` is a TorchFunctionMode entered around the first forward only (the
`SpatialRuntime` hooks; a later forward runs at full speed, and a compiled forward is not
watched). Each such operation is checked against who called it: the first caller outside torch
itself. exatrain's own layers may; the user's code, on a tensor that still has the input's
spatial dims while the samples are split, is refused before the first step with the function,
the line that called it, and the fix (the module that does it, which exatrain splits right).
No communication; the cost is one stack walk per such call of the first forward.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

from ...errors import SpatialSplitError

# operations that read neighbouring voxels (a halo) or a whole spatial dim
MIXING = {f"{op}{k}d" for op in ("conv", "conv_transpose", "max_pool", "avg_pool",
                                  "adaptive_avg_pool", "adaptive_max_pool", "lp_pool",
                                  "fractional_max_pool") for k in (1, 2, 3)} | {
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "pad", "unfold",
    "fold", "grid_sample", "roll", "flip", "fft_fftn", "fft_rfftn"}
# reductions: mix voxels when their dims include a spatial one (or are all dims)
REDUCING = {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp",
            "softmax", "log_softmax", "cumsum", "prod"}
MODULE_FOR = {"conv": "nn.Conv{k}d", "interpolate": "nn.Upsample", "upsample": "nn.Upsample",
              "pad": "the convolution's own padding= / padding_mode=",
              "max_pool": "nn.MaxPool{k}d", "avg_pool": "nn.AvgPool{k}d",
              "adaptive": "nn.AdaptiveAvgPool{k}d(1) with nn.Flatten(1)"}


def _user_caller():
    """(file, line) of the first caller outside torch, or None when that caller is exatrain."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "torch" or module.startswith(("torch.", "functools", "contextlib"))):
            if module == "exatrain" or module.startswith("exatrain."):
                return None
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _reduces_space(func_name: str, args, kwargs, spatial: int, ndim: int) -> bool:
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        return False  # torch.max(a, b) and the like: elementwise
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dims is None:
        return func_name not in ("softmax", "log_softmax", "cumsum")  # those need a dim
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return any(d % ndim >= ndim - spatial for d in dims if isinstance(d, int))


class BlockMixingGuard(TorchFunctionMode):
    """The check of the module docstring, for one forward of the model `runtime` serves."""

    def __init__(self, runtime, model: str):
        super().__init__()
        self.runtime, self.model = runtime, model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        rt = self.runtime
        if (name in MIXING or name in REDUCING) and not rt.gathered and rt.input_dims:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input")
            if isinstance(x, torch.Tensor) and x.dim() - 2 == rt.input_dims and (
                    name in MIXING or _reduces_space(name, args, kwargs, rt.input_dims, x.dim())):
                where = _user_caller()
                if where is not None:
                    raise SpatialSplitError(self._message(name, where))
        return func(*args, **kwargs)

    def _message(self, name: str, where: str) -> str:
        k = self.runtime.input_dims
        if name in REDUCING:
            module = (f"nn.AdaptiveAvgPool{k}d(1) with nn.Flatten(1) for a global pool, or "
                      f"nn.GroupNorm / nn.InstanceNorm{k}d for statistics per sample,")
        else:
            module = next((m.format(k=k) for key, m in MODULE_FOR.items()
                           if name.startswith(key)),
                          "an nn.Module exatrain splits (the spatial guide lists them)")
        kind = ("reduces over the spatial dims" if name in REDUCING
                else "reads neighbouring voxels")
        return (f"{self.model}.forward calls {name} at {where} on a tensor split into blocks "
                f"under space={self.runtime.parts}: it {kind}, and on a rank's block it would "
                f"differ from one process. Use {module} as a module in __init__ instead (exatrain "
                f"splits it with halos or global statistics), apply it after an nn.Flatten / "
                f"global pool, or use space=(1, 1, 1).")
