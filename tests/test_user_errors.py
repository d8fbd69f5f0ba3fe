"""Every error of the user's making, caused as a user would cause it, through the command line.

Each subclass of `exatrain.errors.UserError` has a case here (a test fails when one has none, and
when the errors reference page leaves one out). A case runs `exatrain run` (or the command the
input belongs to: `predict`, `report`; or a script calling `et.fit` under `exatrain run SCRIPT`)
with one input wrong, and checks what the user sees: exit status 2, one line `exatrain: CLASS:
…` (`CLASS on rank R` under several ranks: the first rank to fail speaks for all, once) naming
the value and the fix, and no traceback. A genuine internal error -- an exception from the user's
model forward -- keeps its traceback and says it is internal.

Cheap by design: one tiny user workload (a Python file whose `model.kind` picks what goes
wrong), the shared 16³ CosmoFlow files of conftest, one rank in this process wherever the error
does not need two; spawned ranks only for the refusals of parallelism and the staging case, which
runs as the real `exatrain` process on a real 64 KiB tmpfs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exatrain.cli import main

ROOT = Path(__file__).parents[1]

WORKLOAD = '''
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import exatrain as et


class Attention(nn.Module):
    """nanoGPT's spelling: the head size from the full width read off the input."""

    def __init__(self, width=16, heads=4):
        super().__init__()
        self.n_head, self.head_dim = heads, width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(16), Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x):
        return self.used(x)


class Buggy(nn.Linear):
    def forward(self, x):
        raise ValueError("shapes (4, 4) and (3,) do not broadcast")   # a bug in the model


class Slow(TensorDataset):
    def __getitem__(self, index):
        time.sleep(0.3)   # a batch of 4 takes 1.2 s, longer than run.timeout_s
        return super().__getitem__(index)


class Shaped(TensorDataset):
    """Samples as some people write them: a dict, two inputs, two targets, NumPy's float64."""

    def __init__(self, kind, x, y):
        super().__init__(x, y)
        self.kind = kind

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return {"dict": {"x": x, "y": y}, "inputs": (x, x, y), "targets": (x, (y, y)),
                "float64": (x.double().numpy(), y),
                "ragged": (x[:1 + index % 3], y)}[self.kind]   # atoms, 1 to 3 of them


class Stream(torch.utils.data.IterableDataset):
    """Samples as a generator yields them: iterable-style, no index (a length, though)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))

    def __len__(self):
        return len(self.x)


def build(kind: str = "ok") -> et.Task:
    g = torch.Generator().manual_seed(0)
    shape = {"attention": (3, 16), "image": (1, 6, 6)}.get(kind, (4,))
    x = torch.randn(16, *shape, generator=g)
    y = x if kind in ("attention", "image") else x[..., :1]
    models = {"attention": lambda: nn.Sequential(Block()), "unused": Unused,
              "bug": lambda: Buggy(4, 1), "image": lambda: nn.Conv2d(1, 1, 3, padding=1),
              "float64_pipe": lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))}
    model = models.get(kind, lambda: nn.Linear(4, 1))()
    loss = (lambda o, t: F.mse_loss(o, t) * float("nan")) if kind == "nan" else \
        (lambda o, t: F.mse_loss(o, t, reduction="none")) if kind == "per_sample" else F.mse_loss
    train = (Slow if kind == "slow" else TensorDataset)(x, y)
    if kind in ("dict", "inputs", "targets", "float64", "float64_pipe", "ragged"):
        train = Shaped(kind.removesuffix("_pipe"), x, y)
    if kind == "iterable":
        train = Stream(x, y)
    return et.Task(model=model, train_set=train,
                   val_set=None if kind == "no_val" else TensorDataset(x, y), loss=loss)
'''

PIPE_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et

if __name__ == "__main__":
    x = torch.randn(16, 4)
    data = TensorDataset(x, x[:, :1])
    et.fit(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), data, data, loss=F.mse_loss,
           plan=et.Plan(pipe=4), train={"steps": 2, "batch_size": 8}, parallel={"microbatches": 4},
           run={"out_dir": "runs"})
'''

MODEL_INPUT_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import exatrain as et

if __name__ == "__main__":
    x = torch.rand(8, 16, 16, 16, 4)      # cubes as CosmoFlow files store them: channels last
    data = TensorDataset(x, torch.rand(8, 4))
    et.fit(et.models.CosmoFlow(size=16, base_channels=4, conv_layers=4), data, data,
           loss=F.mse_loss, train={"steps": 1, "batch_size": 4, "num_workers": 0},
           run={"out_dir": "runs"})
'''

MODEL_CODE_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et


class Forces(nn.Module):           # an energy and its forces, -dE/dx, without enable_grad
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        x.requires_grad_(True)
        energy = self.net(x)
        return torch.cat([energy, -torch.autograd.grad(energy.sum(), x, create_graph=True)[0]], 1)


if __name__ == "__main__":
    x = torch.randn(8, 3)
    data = TensorDataset(x, torch.randn(8, 4))
    et.fit(Forces, data, data, loss=F.mse_loss,
           train={"steps": 1, "batch_size": 4, "num_workers": 0}, run={"out_dir": "runs"})
'''

TINY_COSMO = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
              "data.generate=false", "train.batch_size=8", "train.steps=1", "train.eval_every=0",
              "train.num_workers=0"]


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.fixture
def user(tmp_path):
    """`--set`s for a run of the tiny user workload with `model.kind` = kind."""
    (tmp_path / "wl.py").write_text(WORKLOAD)

    def make(kind: str = "ok", *overrides: str) -> list[str]:
        return sets(f"run.workload={tmp_path}/wl.py", f"model.kind='{kind}'", "train.steps=2",
                    "train.batch_size=4", "train.eval_every=0", "train.checkpoint_every=0",
                    "train.num_workers=0", f"run.out_dir={tmp_path}/runs", *overrides)
    return make


@pytest.fixture
def cosmo(cosmo_data, tmp_path):
    def make(*overrides: str) -> list[str]:
        return sets(*TINY_COSMO, f"data.path={cosmo_data}", f"run.out_dir={tmp_path}/runs",
                    *overrides)
    return make


# --------------------------------------------------------------------------- the cases
# Each: (the argv of `exatrain`, given tmp_path and the fixtures) and the texts the one line must
# hold (the value and the fix; {tmp} is tmp_path). Environment variables a case sets are in ENV.

def _corrupt_cosmo(tmp_path):
    (tmp_path / "train.h5").write_bytes(b"this is not HDF5")
    (tmp_path / "val.h5").write_bytes(b"nor this")
    return tmp_path


def _bad_graph(tmp_path):
    for name in ("edge_index", "node_feat", "node_label"):
        (tmp_path / f"{name}.csv").write_text("not,numbers\n")
    return tmp_path


def _damaged_checkpoint(tmp_path, user):
    assert main(["run", "--nproc", "1", *user("ok", "train.checkpoint_every=2")]) == 0
    (run_dir,) = (tmp_path / "runs").glob("wl-*")
    (ckpt,) = (run_dir / "checkpoints").glob("step_*")
    victim = next(p for p in sorted(ckpt.iterdir()) if p.is_file() and p.name != "manifest.json")
    victim.unlink()
    return run_dir


def _nested_json(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps({"figures": {"a": 1}}))
    return tmp_path / "b.json"


CASES = {
    "ArgumentError": (lambda t, u, c: ["report", str(_nested_json(t))],
                      ["b.json", "one flat object of figures", "exatrain bench NAME --json"]),
    "CheckpointError": (lambda t, u, c: ["run", "--resume", str(_damaged_checkpoint(t, u)),
                                                "--nproc", "1"],
                        ["step_00000002", "listed in its manifest is missing"]),
    "ConfigError": (lambda t, u, c: ["run", "--nproc", "1", *u("ok", "train.grad_accum=0")],
                    ["train.grad_accum=0", "whole numbers ≥ 1"]),
    "DataError": (lambda t, u, c: ["run", "--nproc", "1", *c(f"data.path={_corrupt_cosmo(t)}")],
                  ["train.h5", "sample 0", "not a readable CosmoFlow file"]),
    "GraphFileError": (lambda t, u, c: ["run", "--nproc", "1", *sets(
        "run.workload='gcn'", f"data.path={_bad_graph(t)}", "data.generate=false",
        f"run.out_dir={t}/runs")], [".csv: cannot be read as a numeric array", "Write it as .npy"]),
    "InitFromError": (lambda t, u, c: ["run", "--nproc", "1",
                                       *u("ok", f"model.init_from={t}/nothing.safetensors")],
                      ["model.init_from={tmp}/nothing.safetensors", "no such file"]),
    "InjectError": (lambda t, u, c: ["run", "--nproc", "1", *u("ok")],
                    ["EXATRAIN_INJECT_FAULTS", "'boom'", "kind@rank:step"]),
    "LaunchError": (lambda t, u, c: ["run", *u("ok")], ["MASTER_ADDR", "export MASTER_ADDR"]),
    "LoaderTimeout": (lambda t, u, c: ["run", "--nproc", "1", *u(
        "slow", "train.num_workers=1", "run.timeout_s=0.5")],
                      ["0.5 s (run.timeout_s)", "train.num_workers=0"]),
    "LossError": (lambda t, u, c: ["run", "--nproc", "1", *u("per_sample")],
                  ["the loss returned Tensor (4, 1) float32", "reduction='mean' (not 'none')",
                   "loss.mean()"]),
    "MissingFileError": (lambda t, u, c: ["run", "--nproc", "1", *c(f"data.path={t}/nothing")],
                         ["{tmp}/nothing", "exatrain data cosmoflow --out DIR"]),
    "ModelInputError": (lambda t, u, c: ["run", str(_script(t, MODEL_INPUT_SCRIPT)), "--nproc",
                                         "1"],
                        ["CosmoFlow expects input (B, 4, 16, 16, 16), got (4, 16, 16, 16, 4)",
                         "x.permute(0, 4, 1, 2, 3)"]),
    "ModelCodeError": (lambda t, u, c: ["run", str(_script(t, MODEL_CODE_SCRIPT)), "--nproc",
                                        "1"],
                       ["Forces.forward differentiates (torch.autograd.grad)", "gradients are off",
                        "`with torch.enable_grad():`"]),
    "ModelOptionError": (lambda t, u, c: ["run", "--nproc", "1",
                                          *c("model.conv_layers=5")],
                         ["size=16", "divisible by 2^5"]),
    "NonFiniteLoss": (lambda t, u, c: ["run", "--nproc", "1", *u("nan")],
                      ["loss nan", "Lower optim.lr"]),
    "ParallelizeError": (lambda t, u, c: ["run", "--nproc", "1",
                                          *u("ok", "parallel.activation_checkpointing='full'")],
                         ["Linear has no blocks to checkpoint",
                          "parallel.activation_checkpointing='none'"]),
    "PipeSplitError": (lambda t, u, c: ["run", str(_script(t)), "--nproc", "4"],
                       ["Sequential has 2 layers", "use at most 2 stages"]),
    "PlanError": (lambda t, u, c: ["run", "--nproc", "2", *u("ok", "plan.data=3")],
                  ["needs 3 ranks but the job has 2", "Use data=2"]),
    "PredictError": (lambda t, u, c: ["predict", str(t)], ["{tmp}", "not a run directory"]),
    "ReplicaGroupError": (lambda t, u, c: ["run", "--nproc", "1",
                                           *u("ok", "fault_tolerance.enabled=true",
                                              "fault_tolerance.groups=2", "plan.data=2")],
                          ["REPLICA_GROUP_ID = 0..1", "got '5'", "its own REPLICA_GROUP_ID"]),
    "ResumeError": (lambda t, u, c: ["run", "--resume", str(t)],
                    ["--resume {tmp}", "no complete checkpoint", "start a new run"]),
    "SpatialSplitError": (lambda t, u, c: ["run", "--nproc", "2",
                                           *u("image", "plan.space=[2, 1, 1]")],
                          ["Conv2d", "2 spatial dims (h, w)", "space=(2, 1, 1)",
                           "e.g. space=(1, 2, 1)"]),
    "StagingError": None,   # the real process on a real tmpfs: its own test below
    "TensorSplitError": (lambda t, u, c: ["run", "--nproc", "2", *u("attention", "plan.tensor=2")],
                         ["'0.attn' (Attention)", "C // self.n_head", "self.head_dim"]),
    "UnusedParameterError": (lambda t, u, c: ["run", "--nproc", "2", *u("unused", "plan.data=2")],
                             ["spare.weight", "requires_grad_(False)"]),
}
ENV = {"InjectError": {"EXATRAIN_INJECT_FAULTS": "boom"},
       "ReplicaGroupError": {"REPLICA_GROUP_ID": "5"},   # a group id beyond the groups
       "LaunchError": {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": ""}}
SPAWNED = {"ModelCodeError", "ModelInputError", "PipeSplitError", "SpatialSplitError",
           "TensorSplitError", "UnusedParameterError"}


def _script(tmp_path, text=PIPE_SCRIPT):
    (tmp_path / "script.py").write_text(text)
    return tmp_path / "script.py"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


USER_ERRORS = [cls.__name__ for cls in _hooks().user_errors()[1:]]   # the base is never raised


def refused(code: int, err: str, name: str, texts: list[str], ranks: bool = False) -> str:
    """The one message the user sees, after checking it: exit 2, no traceback, one line that
    starts `exatrain: NAME` (more only where the message lists choices), the texts named."""
    heads = [i for i, line in enumerate(err.splitlines())
             if re.match(r"exatrain: [A-Z]\w*( on rank \d+)?: ", line)]
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    assert len(heads) == 1, err[-3000:]
    message = "\n".join(err.splitlines()[heads[0]:])   # a message may list choices below
    head = f"exatrain: {name} on rank " if ranks else f"exatrain: {name}: "
    assert message.startswith(head), message
    for text in texts:
        assert text in message, (text, message)
    return message


def test_every_user_error_has_a_case_and_an_entry_in_the_reference_page():
    from exatrain.errors import UserError

    assert set(USER_ERRORS) == set(CASES), "a UserError without a case here, or a stale case"
    page = _hooks().errors_reference()
    for cls in _hooks().user_errors():
        assert f"### `{cls.__name__}`" in page and issubclass(cls, UserError)
        meaning, fix = _hooks().meaning_and_fix(cls)
        assert meaning and fix, f"{cls.__name__}: its docstring needs a meaning and 'What to do:'"
    assert _hooks().ERRORS_MARKER in (ROOT / "docs" / "reference" / "errors.md").read_text()


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case])
def test_a_user_error_is_one_line_naming_the_value_and_the_fix(name, user, cosmo, tmp_path,
                                                                capsys, monkeypatch):
    argv, texts = CASES[name]
    for key, value in ENV.get(name, {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    args = argv(tmp_path, user, cosmo)
    capsys.readouterr()
    code = main(args)
    refused(code, capsys.readouterr().err, name, [t.replace("{tmp}", str(tmp_path)) for t in texts],
            ranks=name in SPAWNED)


def test_a_kfac_layer_that_ran_no_forward_is_one_line(user, tmp_path, capsys):
    """K-FAC preconditions every trained Linear; one the forward never uses (`spare`) stops the
    first step, before any collective, naming the layer, the rank and the fixes."""
    capsys.readouterr()
    code = main(["run", "--nproc", "2", *user("unused", "plan.data=2", "optim.name='kfac'")])
    refused(code, capsys.readouterr().err, "UnusedParameterError",
            ["K-FAC: layer 'spare' (Linear) ran no forward in step 0",
             "requires_grad_(False)", "optim.name='adamw'"], ranks=True)


def test_a_halo_wider_than_a_block_is_a_spatial_split_error():
    """The exchange plan itself refuses a halo that a neighbour's block cannot supply (the
    layers refuse the same geometry earlier, naming the layer; a direct user of comm.halo
    gets this), naming the rank, the block and the fix."""
    import exatrain as et
    from exatrain.comm import Axis, Ledger
    from exatrain.comm.halo import Halo, SplitDim

    space = Axis("space", 4, 1, None, Ledger())
    # blocks of 2 along dim 2, a kernel-7 window: halos of 3 on each side
    wide = SplitDim(2, 4, 1, 1, (0, 3, 3, 3), (3, 3, 3, 0))
    with pytest.raises(et.SpatialSplitError) as caught:
        Halo(space, [wide], (1, 1, 2, 8))
    text = str(caught.value)
    assert isinstance(caught.value, et.UserError)
    assert "rank 1 of 'space'" in text and "block is 2 wide" in text
    assert "at most 2 parts (plan.space)" in text and "larger input" in text


def test_every_user_error_is_exported_for_scripts_to_catch():
    import exatrain as et

    for cls in _hooks().user_errors():
        assert getattr(et, cls.__name__, None) is cls and cls.__name__ in et.__all__, cls
    assert issubclass(et.ModelInputError, et.UserError)
    assert issubclass(et.ModelInputError, ValueError)   # callers that catch ValueError still do


def test_a_staging_directory_too_small_is_one_line_from_the_real_command(cosmo_data, tmp_path):
    """The issue's case: `exatrain run --nproc 2 --set data.stage_to=...` on a tmpfs too small
    for the data set. A real 64 KiB tmpfs (mounted as root), the real `exatrain` process."""
    stage = tmp_path / "tiny"
    stage.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(stage)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:  # as the Slurm and host tests: fail, saying what is needed
        pytest.fail("this test mounts a 64 KiB tmpfs and must run as root (as .ci/run does): "
                    f"mount said {mounted.stderr.strip()!r}")
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2",
                               *sets(*TINY_COSMO, f"data.path={cosmo_data}",
                                     f"run.out_dir={tmp_path}/runs", f"data.stage_to='{stage}'")],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(stage)], check=True)
    refused(done.returncode, done.stderr, "StagingError", [
        f"data.stage_to={stage}", "KiB free, the copy needs", "larger node-local directory"],
        ranks=True)


@pytest.mark.parametrize("kind, texts", [
    ("dict", ["train_set[0] is dict with keys ['x', 'y']", "return d['x'], d['y']"]),
    # TensorDataset(x, p, y): a model of two inputs, whose data set gives three tensors
    ("inputs", ["train_set[0] is tuple of 3 (Tensor (4,) float32, Tensor (4,) float32, "
                "Tensor (1,) float32)", "return `(x0, x1), target`", "model(x0, x1)"]),
    ("targets", ["train_set[0] is tuple of 2 (Tensor (4,) float32, tuple of 2 (Tensor (1,)",
                 "split it in the loss"]),
    ("float64", ["the model's input is float64 (NumPy's default) and its forward failed on it "
                 "(mat1 and mat2 must have the same dtype", "x.astype(np.float32)"]),
    ("float64_pipe", ["the model's input is float64 (NumPy's default) and its forward failed on "
                      "it (mat1 and mat2 must have the same dtype", "x.astype(np.float32)"]),
    ("no_val", ["val_set is None", "random_split(data, [0.9, 0.1]"]),
    # samples of different sizes (molecules): found where the first batch is stacked
    ("ragged", ["the samples of one batch differ in the shape of their input: (", ",) in its "
                "sample 0, (", "Pad them in the data set to the largest size",
                "et.fit(..., collate_fn=)"]),
    ("iterable", ["train_set is Stream (an iterable-style data set)",
                  "map-style Dataset, with __getitem__"]),
])
def test_samples_that_are_not_an_input_and_a_target_are_refused_before_the_first_step(
        kind, texts, user, tmp_path, capsys):
    """A sample the step cannot move to the device and feed to model(input) is named, with its
    structure and the fix, before any step (no metrics were written); so are a missing
    validation set, a data set that cannot be read by index, and samples that do not stack
    into a batch."""
    capsys.readouterr()
    pipe = kind.endswith("_pipe")   # under pipe=2 the stages run the forward: the same message
    code = main(["run", "--nproc", "2" if pipe else "1",
                 *user(kind, *(["plan.pipe=2"] if pipe else []))])
    refused(code, capsys.readouterr().err, "DataError", texts, ranks=pipe)
    assert not list((tmp_path / "runs").glob("*/metrics.jsonl"))


def test_a_bug_in_the_model_forward_is_internal_and_keeps_its_traceback(user, tmp_path, capsys):
    code = main(["run", "--nproc", "1", *user("bug")])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback (most recent call last)" in err and "wl.py" in err and "in forward" in err
    assert "exatrain: internal error (a bug in exatrain or in the model code" in err
    assert "ValueError: shapes (4, 4) and (3,) do not broadcast" in err


def test_ranks_waiting_on_rank_0_relay_its_error_as_the_same_class_when_it_is_the_users():
    """Under torchrun / srun every rank prints its own failure: the ranks that wait for rank 0's
    data preparation (train.job.prepare_run) raise what `relayed` gives them: the class of rank
    0's error when it is the user's (so they too exit 2 with one line), else a RuntimeError."""
    from exatrain.errors import DataError, is_user_error, relayed

    cls, text = relayed(DataError("d/train.h5: not a readable CosmoFlow file"), "prepare the data")
    assert cls is DataError
    assert text == ("rank 0 could not prepare the data: DataError: d/train.h5: not a readable "
                    "CosmoFlow file")
    assert is_user_error(cls(text))
    cls, text = relayed(OSError(28, "No space left on device"), "prepare the data")
    assert cls is RuntimeError and "OSError: [Errno 28] No space left on device" in text


def _fit_with_a_summed_loss(cases: list, out_dir: str) -> list:
    """On every rank: `et.fit` of a small MLP whose loss sums over the batch, under each (Plan,
    train.grad_accum); the val_loss, or the error's class and message."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    import exatrain as et

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    data = TensorDataset(x, torch.tanh(x[:, :1]))
    out = []
    for plan, accum in cases:
        try:
            summary = et.fit(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                             data, data, loss=lambda o, t: F.mse_loss(o, t, reduction="sum"),
                             plan=et.Plan(**plan), run={"out_dir": out_dir},
                             train={"steps": 2, "batch_size": 8, "grad_accum": accum,
                                    "eval_every": 0, "num_workers": 0})
            out.append(summary["val_loss"])
        except et.UserError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_a_loss_summed_over_the_batch_is_refused_where_each_batch_is_cut_into_parts(tmp_path):
    """reduction="sum" under data=2 made every update half of one process's, silently (a
    probe: val_loss 2.01 against one process's 22.99); pipe's micro-batches and grad_accum cut
    the batch too. Where nothing cuts it (one process, tensor) the sum trains as written."""
    from harness import run_ranks

    one, accum = run_ranks(1, _fit_with_a_summed_loss, [({}, 1), ({}, 2)], str(tmp_path))[0]
    assert isinstance(one, float), one   # what the user wrote, on one process
    for words in ("LossError: the loss adds over the samples of a batch", "reduction='sum'",
                  "cuts each batch into 2 parts (train.grad_accum 2)", "2 times smaller",
                  "reduction='mean'", "multiply optim.lr by train.batch_size"):
        assert words in accum, (words, accum)
    for rank in run_ranks(2, _fit_with_a_summed_loss, [({"data": 2}, 1), ({"pipe": 2}, 1),
                                                        ({"tensor": 2}, 1)], str(tmp_path)):
        data2, pipe2, tensor2 = rank
        assert "cuts each batch into 2 parts (replicas 2)" in data2, data2
        assert "cuts each batch into 4 parts (micro-batches 4)" in pipe2, pipe2
        assert tensor2 == pytest.approx(one, rel=1e-5)   # tensor replicas share the batch
