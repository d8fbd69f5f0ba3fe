"""`parallel.compile = true` compiles the step of every built-in workload for real: Dynamo
produces graphs, the model's frame does not break, and the run summary says so.

Dynamo's counters do not depend on the backend, so the cheap "eager" backend is used (the
kernels themselves are Inductor's business; what is tested here is that the model is captured
whole). One process, a few steps of each workload at a tiny size.
"""

from __future__ import annotations

import pytest
import torch

from exatrain.train.config import load_config
from exatrain.train.run import setup

COMMON = ["run.nproc=1", "plan.data=1", "train.steps=3", "train.log_every=3", "train.eval_every=0",
          "train.checkpoint_every=0", "data.generate=true", "parallel.compile=true",
          "parallel.compile_backend='eager'", "schedule.warmup_steps=0"]

WORKLOADS = {
    "cosmoflow": ["model.size=16", "model.conv_layers=4", "model.base_channels=4",
                  "data.size=16", "data.samples=12", "train.batch_size=2"],
    "deepcam": ["model.variant='small'", "model.width=4", "model.dropout=0.0", "data.height=32",
                "data.width=48", "data.channels=16", "data.samples=10", "train.batch_size=2"],
    "vit": ["model.patch_size=8", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
            "data.height=16", "data.width=32", "data.trajectories=2", "data.steps=4",
            "train.batch_size=2"],
    "gpt": ["model.vocab_size=256", "model.block_size=32", "model.n_layer=1", "model.n_head=2",
            "model.n_embd=16", "data.max_bytes=200000", "data.val_samples=4",
            "train.batch_size=2"],
    "gcn": ["model.hidden=16", "model.layers=2", "data.nodes=500", "data.parts=1",
            "train.batch_size=1"],
    "qm9": ["model.features=16", "model.interactions=1", "model.rbf=8",
            "data.train_molecules=64", "data.val_molecules=16", "train.batch_size=8"],
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS) + ["cosmoflow:blocks"])
def test_compile_captures_the_whole_model(workload, tmp_path, one_thread):
    """`cosmoflow:blocks` compiles each block (compile_scope = "blocks"): CosmoFlow's blocks are
    `nn.Sequential`s, torch's own class, which `nn.Module.compile()` left eager."""
    workload, _, scope = workload.partition(":")
    config = load_config(None, [f"run.workload='{workload}'", *COMMON, *WORKLOADS[workload],
                                f"parallel.compile_scope='{scope or 'auto'}'",
                                f"data.path='{tmp_path}/data'", f"run.out_dir='{tmp_path}/runs'"])
    torch._dynamo.reset()
    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
    finally:
        mesh.close()
    assert summary["compiled_graphs"] >= 1, summary
    assert summary["graph_breaks"] == 0, summary["graph_break_reasons"]
    first = next(h for h in trainer.history if "loss" in h)
    # the run's later graphs (evaluation's: eval mode, no autograd) add to the first report's
    assert summary["compiled_graphs"] >= first["compiled_graphs"] >= 1
    assert first["graph_breaks"] == 0


def test_auto_scope_compiles_repeated_blocks_one_by_one_and_other_models_whole():
    """A model that repeats one block 4 times or more compiles block by block (one block's
    compile time, the graph reused), a CNN whole (fusions across layers), anything under FSDP2
    block by block."""
    from torch import nn

    from exatrain.parallel.compile import auto_compile_scope

    class Tower(nn.Module):  # written as users write them: a list of equal layers
        def __init__(self, widths):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    assert auto_compile_scope(Tower([8, 8, 8, 8, 8]), fsdp=False) == "blocks"  # 4 equal layers
    assert auto_compile_scope(Tower([8, 16, 8]), fsdp=False) == "model"   # not one block repeated
    assert auto_compile_scope(Tower([8, 8, 8, 8]), fsdp=False) == "model"  # 3: compiled whole
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    assert auto_compile_scope(cnn, fsdp=False) == "model"
    assert auto_compile_scope(cnn, fsdp=True) == "blocks"


def test_the_cpu_memory_tracker_leaves_compile_at_work():
    """The CPU peak tracker is a TorchDispatchMode; active under a compiled frame, it made Dynamo
    skip that frame's code for good, so every later variant of the forward (evaluation's, a new
    batch shape) ran eager without a word. The tracked step runs eager instead."""
    from torch import nn
    from torch._dynamo.utils import counters

    from exatrain.parallel.compile import compile_in_place
    from exatrain.observe.memory_meters import StepPeak

    class Net(nn.Module):  # a class of this test's own: its forward was never compiled before
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    net = compile_in_place(Net(), "eager")
    x = torch.randn(3, 4)
    net(x).sum().backward()
    peak = StepPeak(torch.device("cpu"))
    with peak.track():
        net(x).sum().backward()
    assert peak.bytes > 0
    before = counters["frames"]["total"]
    net.eval()
    with torch.no_grad():
        net(x)
    assert counters["frames"]["total"] == before + 1  # evaluation's variant was compiled


def test_cuda_graphs_are_refused_on_a_cpu_before_any_work(tmp_path, one_thread):
    """A run asking for CUDA graphs on a CPU stops at parallelize, naming the device and the fix."""
    from exatrain.errors import ParallelizeError
    config = load_config(None, ["run.workload='gpt'", *COMMON, *WORKLOADS["gpt"],
                                "parallel.cuda_graphs=true", f"data.path='{tmp_path}/data'",
                                f"run.out_dir='{tmp_path}/runs'"])
    with pytest.raises(ParallelizeError, match=r"needs a GPU; this run's device is 'cpu'.*"
                                               r"parallel.cuda_graphs=false"):
        setup(config)


@pytest.mark.parametrize("case,expected", [
    ({}, None),
    ({"compile": False}, r"set parallel.compile=true as well"),
    ({"pipe": 2}, r"pipeline schedules.*plan.pipe=1"),
    ({"shard": 2}, r"FSDP2.*zero_stage=2"),
    ({"optimizer": "kfac"}, r"optim.name='kfac'.*adamw or sgd"),
])
def test_cuda_graphs_are_refused_where_a_graph_cannot_hold_the_step(case, expected):
    """On a GPU: refused without compile, under pipe schedules, FSDP2 and K-FAC; each message
    names the setting to change."""
    import re

    from exatrain.parallel.options import ParallelOptions, cuda_graphs_refusal
    from exatrain.plan import Plan
    options = ParallelOptions(compile=case.get("compile", True), cuda_graphs=True)
    plan = Plan(pipe=case.get("pipe", 1), shard=case.get("shard", 1))
    refusal = cuda_graphs_refusal(plan, options, "cuda", case.get("optimizer", "adamw"))
    assert (refusal is None) if expected is None else re.search(expected, refusal), refusal
    assert cuda_graphs_refusal(plan, ParallelOptions(), "cpu") is None  # off: nothing to refuse
