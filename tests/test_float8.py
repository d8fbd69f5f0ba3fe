"""fp8 training (`parallel.precision = "fp8"`): refused before the first step where it cannot run
(a CPU, a GPU below compute capability 8.9, tensor parallelism, a model with nothing to convert),
and the layers it converts: exactly the Linears whose sizes `torch._scaled_mm` takes, through
torchao. Tolerance of the numerics check: torchao's float8 forward against bf16 on the same
weights, relative 0.1 (e4m3 keeps 3 mantissa bits: measured 0.05 on this model)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et
from exatrain.errors import ParallelizeError
from exatrain.parallel.float8 import convert_linears, eligible, float8_refusal


def test_fp8_on_a_cpu_is_refused_before_the_first_step_naming_the_device_and_the_fix(tmp_path):
    x = torch.randn(32, 16)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    with pytest.raises(ParallelizeError, match=r"needs a GPU with fp8 tensor cores.*device is "
                                               r"'cpu'.*parallel.precision='bf16'") as caught:
        et.fit(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), data,
               data, loss=F.mse_loss, parallel={"precision": "fp8"},
               train={"steps": 2, "batch_size": 8}, run={"out_dir": str(tmp_path)})
    assert not list(tmp_path.rglob("metrics.jsonl")) or \
        all(p.read_text() == "" for p in tmp_path.rglob("metrics.jsonl"))  # no step was taken
    assert isinstance(caught.value, et.errors.UserError)


def test_the_refusals_name_what_stops_fp8():
    cpu = torch.device("cpu")
    assert "device is 'cpu'" in float8_refusal(cpu)
    assert float8_refusal(cpu, nn.Linear(16, 16)) == float8_refusal(cpu)  # the device first


def test_exactly_the_linears_scaled_mm_takes_are_converted():
    pytest.importorskip("torchao.float8", reason="the fp8 extra: pip install -e '.[fp8]'")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 10),
                          nn.LayerNorm(10))
    reference = copy.deepcopy(model)
    assert [eligible(m) for m in model] == [True, False, True, False, False]
    assert convert_linears(model) == 2
    names = [type(m).__name__ for m in model]
    assert names == ["Float8Linear", "GELU", "Float8Linear", "Linear", "LayerNorm"]
    # a micro-batch's tokens (the weight gradient's inner size) need not be a multiple of 16
    assert model[0].config.pad_inner_dim and model[2].config.pad_inner_dim
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, ref = model(x).float(), reference(x).float()
    assert (ours - ref).norm() / ref.norm() < 0.1
    ours.sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.dtype == torch.float32
