"""fp8 training (`parallel.precision = "fp8"`): torchao's float8 Linear layers under bf16 autocast.

Each eligible `nn.Linear` becomes torchao's `Float8Linear` (`convert_to_float8_training`, the
"tensorwise" recipe: dynamic per-tensor scales). Forward: input and weight are cast to e4m3 with
one scale each (the tensor's absolute maximum over e4m3's largest value), multiplied by
`torch._scaled_mm` on the fp8 tensor cores, output in bf16. Backward: the output gradient is
cast to e5m2 (more range, less precision) and both gradient products run in fp8 too. Master
weights, optimizer state and gradient reductions stay fp32, as under bf16; the rest of the model
(attention's softmax, norms, convolutions) runs under bf16 autocast. Communication is unchanged:
no collective moves fp8 data.

Eligible: both sizes divisible by 16 (what `_scaled_mm` needs); a micro-batch's token count, the
inner size of the weight gradient's product, is padded to 16 where it is not (`pad_inner_dim`).
torchtitan's habit of keeping the last projection (the language-model head) in bf16 is not
followed: at GPT's vocabulary it is the largest matrix product of the step. Whether the loss
stays within bf16's is what `exatrain bench device --alt-set parallel.precision="fp8"` measures
(`<case>_alt_loss_rel_diff`).

Refused before the first step, with the reason: on a CPU and on GPUs below compute capability 8.9
(no fp8 tensor cores; Ada and Hopper have them), without torchao installed, with nothing to
convert, and under tensor parallelism (its split Linears would need torchao's own float8 tensor
parallel styles).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn


def eligible(module: nn.Module) -> bool:
    """A Linear whose input and output sizes `torch._scaled_mm` takes (multiples of 16)."""
    return (type(module) is nn.Linear and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def float8_refusal(device, model: nn.Module | None = None, tensor_degree: int = 1) -> str | None:
    """Why fp8 training cannot run on `device` for `model` (with the fix); None when it can."""
    device = torch.device(device)
    fix = "set parallel.precision='bf16'"
    if device.type != "cuda":
        return (f"parallel.precision='fp8' needs a GPU with fp8 tensor cores (compute capability "
                f"8.9 or newer: Ada, Hopper); this run's device is {device.type!r}: {fix}.")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (f"parallel.precision='fp8' needs compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}: {fix}.")
    try:
        importlib.import_module("torchao.float8")  # is it installed, and does it load?
    except ImportError:
        return ("parallel.precision='fp8' trains with torchao's float8 layers: "
                "`pip install torchao` (on an offline machine, carry its wheel), or " + fix + ".")
    except Exception as exc:  # noqa: BLE001 - installed, but fails to load with this torch
        return (f"parallel.precision='fp8': torchao is installed but does not load "
                f"({type(exc).__name__}: {exc}); install the torchao release made for torch "
                f"{torch.__version__.split('+')[0]}, or {fix}.")
    if tensor_degree > 1:
        return (f"parallel.precision='fp8' with plan.tensor={tensor_degree}: split Linears in fp8 "
                f"are not built; use fp8 with data/shard/pipe, or {fix}.")
    if model is not None and not any(eligible(m) for m in model.modules()):
        return ("parallel.precision='fp8': the model has no nn.Linear with both sizes divisible "
                f"by 16, so nothing would run in fp8; {fix}.")
    return None


def convert_linears(model: nn.Module) -> int:
    """Swap every eligible Linear of `model` for torchao's Float8Linear, in place; returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    count = sum(1 for m in model.modules() if eligible(m))
    # pad_inner_dim: the weight gradient's product runs over the tokens of a micro-batch, which
    # `_scaled_mm` also wants in multiples of 16; padded (in the kernel) where they are not
    convert_to_float8_training(model, config=Float8LinearConfig(pad_inner_dim=True),
                               module_filter_fn=lambda module, fqn: eligible(module))
    return count
