"""Datasheet dense peak FLOP/s of known accelerators, per compute dtype: MFU's other denominator.

`mfu_peak` divides model FLOP/s by the vendor's dense (no sparsity) tensor-core peak for the
dtype the step computes in; `mfu_measured` (see `observe.matmul_rate.measured_matmul_flops`)
divides by the rate a large square matmul reaches on this very device. The first is the number
papers quote (torchtitan, MLPerf write-ups); the second says how much of what the chip can
actually sustain the model uses.

Figures (TFLOP/s, dense) from NVIDIA's H100, H200 and A100 datasheets; "fp32" is the plain
(non-tensor-core) rate, "tf32" the tensor-core rate used when TF32 matmuls are allowed.
"""

from __future__ import annotations

import torch

# name fragment (lower case, matched against torch.cuda.get_device_name) -> dtype -> TFLOP/s
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "h200": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100 pcie": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "h100 nvl": {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "h100": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def device_key(name: str) -> str | None:
    """The table's entry for a CUDA device name, most specific first; None if unknown."""
    low = name.lower()
    for key in DATASHEET_TFLOPS:  # dict order: "h100 pcie" / "h100 nvl" before plain "h100"
        if all(part in low for part in key.split()):
            return key
    return None


def datasheet_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of `device` in `dtype` ("fp8", "bf16", "fp16", "fp32"); None on a CPU,
    on a device missing from the table, or for a dtype it has no tensor cores for. fp32 counts
    as tf32 when PyTorch allows TF32 matmuls."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    key = device_key(torch.cuda.get_device_name(device))
    if key is None:
        return None
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    tflops = DATASHEET_TFLOPS[key].get(dtype)
    return None if tflops is None else tflops * 1e12
