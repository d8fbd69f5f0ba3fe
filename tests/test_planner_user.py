"""`et.plans` on a user's own model (issue 46, item 5): the planner's memory per rank for the
tutorial's 3D U-Net (8 channels, 2 × 32³ volumes, batch 4, AdamW) against a real CPU run of it
through et.fit: the run summary's state_bytes + peak_activation_bytes (the largest rank), as
`exatrain plan --run-dir` compares them. Measured on this machine: one process +9 %,
Plan(data=2) +11 %, space=(1, 1, 2) +10 % (34.1 MB predicted, 31.1 MB measured); the issue asks
15 %. Under space the peak is in the backward of the decoder's convolution (its input, the skip
concatenation, is the largest activation): `HaloConv` saves the halo-extended block (18 of 32
planes, not 16), and its backward holds the gradient of that extended block and the block's own
gradient at once; the gathered whole output and its gradient are on every rank. Without those
terms (`tune.cost._memory` under space) the prediction was 25.6 MB, 18 % low.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks
from test_spatial_user_models import UNet3D

SAMPLE = (2, 32, 32, 32)
BATCH = 4


def measured_memory(plan: dict, out_dir: str) -> int:
    import exatrain as et
    torch.manual_seed(0)
    x = torch.randn(8, *SAMPLE)
    volumes = torch.utils.data.TensorDataset(x, x[:, :1] ** 2)
    summary = et.fit(lambda: UNet3D(8), volumes, volumes, loss=F.mse_loss, plan=et.Plan(**plan),
                     train={"steps": 3, "batch_size": BATCH, "eval_every": 0, "num_workers": 0},
                     optim={"name": "adamw"}, run={"out_dir": out_dir})
    return max(r["state_bytes"] + r["peak_activation_bytes"] for r in summary["memory_per_rank"])


def test_plan_predicts_a_users_unet_memory_within_15_percent_of_a_run(tmp_path, one_thread):
    import exatrain as et
    predicted = {p["plan"]: p for p in et.plans(UNet3D(8), sample_shape=SAMPLE, world=2,
                                                batch=BATCH)}
    serial = et.plans(UNet3D(8), torch.zeros(BATCH, *SAMPLE), world=1, batch=BATCH)
    assert [p["plan"] for p in serial] == ["Plan()"]
    assert {"Plan(data=2)", "Plan(space=(1, 1, 2))", "Plan(shard=2)"} <= set(predicted)
    cases = [(serial[0], measured_memory({}, str(tmp_path))),
             (predicted["Plan(data=2)"],
              run_ranks(2, measured_memory, {"data": 2}, str(tmp_path))[0]),
             (predicted["Plan(space=(1, 1, 2))"],
              max(run_ranks(2, measured_memory, {"space": (1, 1, 2)}, str(tmp_path / "space"))))]
    for prediction, measured in cases:
        total = prediction["memory_per_rank"]["total"]
        assert abs(total / measured - 1) < 0.15, (prediction["plan"], total, measured)
        assert prediction["step_s"] > 0


def test_plan_names_what_it_needs():
    import pytest

    import exatrain as et
    with pytest.raises(ValueError, match="example= .* or sample_shape="):
        et.plans(UNet3D(), world=2, batch=4)


def test_space_plans_are_refused_for_a_model_whose_layers_space_refuses():
    """A Fourier neural operator's FFT needs the whole field: `parallelize_spatial` refuses its
    Fourier layer, so the planner ranks no space Plan for it and says why; a CNN of weight- and
    spectrally-normed convolutions, which space takes, keeps its space Plans."""
    import exatrain as et
    from user_models import FNO2d, NormedCNN2D

    ranked, refused = et.plans(FNO2d(), sample_shape=(2, 16, 16), world=2, batch=4, refused=True)
    assert ranked and not any("space" in p["plan"] for p in ranked), [p["plan"] for p in ranked]
    why = {r["reason"] for r in refused if r["plan"] in ("Plan(space=(1, 1, 2))",
                                                         "Plan(space=(1, 2, 1))")}
    assert len(why) == 1 and "layer 'fourier.0' (SpectralConv2d)" in why.pop(), refused
    ranked = et.plans(NormedCNN2D(), sample_shape=(2, 16, 16), world=2, batch=4)
    assert {"Plan(space=(1, 1, 2))", "Plan(space=(1, 2, 1))"} <= {p["plan"] for p in ranked}


SCRIPT = '''
import torch, torch.nn.functional as F
from torch import nn
import exatrain as et

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 1, 1))

    def forward(self, x):
        return self.body(x)

if __name__ == "__main__":
    x = torch.randn(8, 2, 16, 16, 16)
    data = torch.utils.data.TensorDataset(x, x[:, :1])
    summary = et.fit(Net, data, data, loss=F.mse_loss, plan=et.Plan(data=2),
                     train={"steps": 3, "batch_size": 4}, optim={"name": "sgd"})
    raise SystemExit("trained: `exatrain plan` should have stopped at et.fit")
'''


def test_exatrain_plan_runs_a_users_script_up_to_et_fit(tmp_path, capsys):
    """`exatrain plan SCRIPT.py --world N`: the script's et.fit predicts instead of training,
    with the script's model, first sample, loss and sections; the same Plans as et.plans."""
    import json

    import exatrain as et
    from exatrain.cli import main
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["plan", str(script), "--world", "2", "--json", str(tmp_path / "p.json")]) == 0
    got = json.loads((tmp_path / "p.json").read_text())
    assert (got["model"], got["batch"], got["optimizer"], got["world"]) == ("Net", 4, "sgd", 2)
    assert got["sample_shape"] == [2, 16, 16, 16]
    namespace = {}
    exec(SCRIPT.split("if __name__")[0], namespace)
    target = torch.zeros(1, 1, 16, 16, 16)   # the script's loss, on its target's shape
    direct = et.plans(namespace["Net"](), sample_shape=(2, 16, 16, 16), world=2, batch=4,
                      optimizer="sgd", loss=lambda out: F.mse_loss(out, target))
    assert [p["plan"] for p in got["ranked"]] == [p["plan"] for p in direct]
    assert [p["memory_per_rank"]["total"] for p in got["ranked"]] == \
        [p["memory_per_rank"]["total"] for p in direct]
    assert main(["plan", str(script), "--world", "2"]) == 0
    printed = capsys.readouterr().out
    assert "Plan(space=(1, 1, 2))" in printed
    # each row names its options: the three shard=2 rows (ZeRO-3, -2, -1) are told apart
    assert [line.split()[1] for line in printed.splitlines() if "Plan(shard=2)" in line
            and " step " in line] == [p["options"] or "-" for p in got["ranked"]
                                      if p["plan"] == "Plan(shard=2)"]
    assert {"zero1", "zero2"} <= {p["options"] for p in got["ranked"]}
    assert not list(tmp_path.glob("runs*")) and not (tmp_path / "checkpoints").exists()


HEADS_SCRIPT = '''
import numpy as np, torch, torch.nn.functional as F
from torch import nn
import exatrain as et

class Heads(nn.Module):
    """A field and a mask head, returned as a dict."""
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU())
        self.field, self.mask = nn.Conv3d(4, 1, 1), nn.Conv3d(4, 1, 1)

    def forward(self, x):
        h = self.body(x)
        return {"field": self.field(h), "mask": self.mask(h)}

def loss(out, y):
    return F.mse_loss(out["field"], y[:, :1]) + F.binary_cross_entropy_with_logits(out["mask"], y[:, 1:])

class Volumes(torch.utils.data.Dataset):
    """NumPy samples, as read from a file: DTYPE volumes, float32 targets."""
    def __init__(self):
        self.x = np.random.default_rng(0).standard_normal((8, 2, 16, 16, 16)).astype(DTYPE)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], np.concatenate([self.x[i, :1], self.x[i, 1:] > 0]).astype(np.float32)

if __name__ == "__main__":
    data = Volumes()
    et.fit(Heads, data, data, loss=loss, train={"steps": 3, "batch_size": 4}, optim={"name": "sgd"})
    raise SystemExit("trained: `exatrain plan` should have stopped at et.fit")
'''


def test_exatrain_plan_takes_numpy_samples_and_a_model_of_several_outputs(tmp_path, capsys):
    """A script whose data set returns NumPy arrays and whose model returns a dict of two heads
    is planned as et.plans plans it on the collated first sample with the script's loss; each
    head is counted in what `space` gathers. NumPy's float64 input is the user's DataError."""
    import json

    import exatrain as et
    from exatrain.cli import main
    script = tmp_path / "heads.py"
    script.write_text(HEADS_SCRIPT.replace("DTYPE", "np.float32"))
    assert main(["plan", str(script), "--world", "2", "--json", str(tmp_path / "p.json")]) == 0
    got = json.loads((tmp_path / "p.json").read_text())
    assert (got["model"], got["sample_shape"]) == ("Heads", [2, 16, 16, 16])
    namespace = {}
    exec(HEADS_SCRIPT.replace("DTYPE", "np.float32").split("if __name__")[0], namespace)
    x, y = torch.utils.data.default_collate([namespace["Volumes"]()[0]])
    direct = et.plans(namespace["Heads"](), example=x, world=2, batch=4, optimizer="sgd",
                      loss=lambda out: namespace["loss"](out, y))
    assert [p["plan"] for p in got["ranked"]] == [p["plan"] for p in direct]
    assert [p["memory_per_rank"]["total"] for p in got["ranked"]] == \
        [p["memory_per_rank"]["total"] for p in direct]
    from exatrain.tune.spec import user_spec
    spec = user_spec(namespace["Heads"](), x)   # both heads keep the volume: both are gathered
    assert spec.extra["flatten_elements"] == 2 * 16 ** 3
    script.write_text(HEADS_SCRIPT.replace("DTYPE", "np.float64"))
    capsys.readouterr()
    assert main(["plan", str(script), "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "the model's input is float64 (NumPy's default)" in err and "x.astype(np.float32)" in err


ARGV_SCRIPT = '''
import sys
import torch, torch.nn.functional as F
from torch import nn
import exatrain as et

if __name__ == "__main__":
    width = int(sys.argv[1])          # the script's own arguments, as `exatrain run` passes them
    x = torch.randn(8, 6)
    data = torch.utils.data.TensorDataset(x, x[:, :2])
    et.fit(nn.Sequential(nn.Linear(6, width), nn.GELU(), nn.Linear(width, 2)), data, data,
           loss=F.mse_loss, train={"steps": 2, "batch_size": 4})
'''


def test_exatrain_plan_passes_the_arguments_after_the_script_to_it(tmp_path, capsys):
    """`exatrain plan train.py --world 2 -- ARGS`, as `exatrain run train.py -- ARGS`: the
    script reads them as its sys.argv[1:]; a config takes none."""
    import json

    from exatrain.cli import main
    script = tmp_path / "train.py"
    script.write_text(ARGV_SCRIPT)
    sizes = {}
    for width in (16, 64):
        out = tmp_path / f"p{width}.json"
        assert main(["plan", str(script), "--world", "2", "--json", str(out), "--",
                     str(width)]) == 0
        ranked = json.loads(out.read_text())["ranked"]
        sizes[width] = max(p["memory_per_rank"]["state"] for p in ranked)
    assert sizes[64] > 3 * sizes[16], sizes   # the width the script was given
    capsys.readouterr()
    assert main(["plan", "--world", "2", "--", "16"]) == 2
    assert "go to a Python script (`exatrain plan train.py --world N -- ARGS`)" in \
        capsys.readouterr().err


def test_the_bytes_a_step_moves_are_counted_for_its_memory_bound_operators():
    """`tune.step_counts.StepCounter` charges an operator every byte it reads and writes, each
    tensor once: a sine of n fp32 elements 8n, a sum of them over the last dim 4n + 4n/100; a
    view or an allocation nothing (no data moves), a matrix product nothing (its FLOPs carry its
    time). Under fake tensors a step of a model moves
    what it moves on real ones (the fake mode's own `prim.device` queries move nothing), and the
    model keeps its gradients (none: the trace's fake ones are not left on it)."""
    from torch import nn

    from exatrain.tune.spec import _fake_mode
    from exatrain.tune.step_counts import StepCounter, count_step

    a, b = torch.randn(100, 100), torch.randn(100, 100)
    with StepCounter() as counter:
        torch.sin(a)
        a.sum(dim=-1)
        a.view(10, 1000).t()
        a @ b
    assert counter.traffic == 8 * a.numel() + (4 * a.numel() + 4 * 100)
    out = torch.empty_like(a)
    with StepCounter() as counter:   # each tensor once: a square reads a once; an out= or
        a * a                        # in-place operator writes what it returns; an empty
        torch.add(a, b, out=out)     # tensor is only allocated
        out.copy_(a)
        torch.empty_like(a)
    assert counter.traffic == 4 * a.numel() * (2 + 3 + 2), counter.traffic / (4 * a.numel())
    # an indexing operator moves the rows it touches: 5 rows of 64 fp32 gathered from 1000 (the
    # indices, the rows read, the output written); added in place into 1000 rows (the indices,
    # the source, the 5 rows read and written); out of place it copies the whole tensor first
    table, rows, index = torch.randn(1000, 64), torch.randn(5, 64), torch.tensor([1, 5, 7, 9, 11])
    gathered = 8 * 5 + 2 * (4 * 5 * 64)
    for gather in (lambda: table.index_select(0, index), lambda: table[index],
                   lambda: torch.nn.functional.embedding(index, table)):
        with StepCounter() as counter:
            gather()
        assert counter.traffic == gathered, counter.traffic
    with StepCounter() as counter:
        table.index_add_(0, index, rows)
    assert counter.traffic == 8 * 5 + 4 * 5 * 64 + 2 * (4 * 5 * 64), counter.traffic
    with StepCounter() as counter:
        table.index_add(0, index, rows)
    assert counter.traffic == 8 * 5 + 4 * 5 * 64 + 2 * table.numel() * 4, counter.traffic
    # a value put into 5 rows (written, not read; the 0-dim value read once), a scatter of a
    # value at 5 × 64 indices, an integer table's index_add_ (its rows read and written)
    spread = index[:, None].expand(5, 64).contiguous()
    counts, ones = torch.zeros(1000, 64, dtype=torch.long), torch.ones(5, 64, dtype=torch.long)
    for scatter, expected in (
            (lambda: table.__setitem__(index, 0.0), 8 * 5 + 4 + 4 * 5 * 64),
            (lambda: table.__setitem__((slice(None), index), 0.0), 8 * 5 + 4 + 4 * 1000 * 5),
            (lambda: table.__setitem__((index[:, None], index[None, :4]), 0.0),
             8 * 5 + 8 * 4 + 4 + 4 * 5 * 4),
            (lambda: table.scatter_(0, spread, 1.0), 8 * 5 * 64 + 4 * 5 * 64),
            (lambda: counts.index_add_(0, index, ones), 8 * 5 + 3 * (8 * 5 * 64))):
        with StepCounter() as counter:
            scatter()
        assert counter.traffic == expected, (counter.traffic, expected)

    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.LayerNorm(32), nn.Linear(32, 1))
    x = torch.randn(4, 16)

    def loss(out):
        return out.square().mean()
    real = count_step(model, (x,), loss)
    with _fake_mode():
        fake = count_step(model, (x,), loss)
    assert fake[1:] == real[1:] and real[2] > 0, (real, fake)
    assert all(p.grad is None for p in model.parameters())
    assert real[1] == 2 * 4 * (16 * 32 + 32 * 1) * 2 + 2 * 4 * 32 * 1   # 3 × forward, less dx


def two_core_system(directory):
    """A system file of 2 cores whose eager elementwise operators move 10 GB/s a core."""
    system = directory / "two-cores.toml"
    system.write_text("name = 'two-cores'\nranks_per_node = 128\nmemory_bytes = 2e10\n"
                      "[flops]\nfp32 = 1e11\n[efficiency]\nmatmul = 1.0\n"
                      "[intra]\nbandwidth = 1e9\nlatency = 1e-5\n[inter]\nbandwidth = 1e9\n"
                      "latency = 1e-5\n[measured]\ncores = 2\nelementwise_bandwidth = 1e10\n")
    return system


def test_a_gnns_step_is_memory_bound_and_the_planner_charges_its_bytes(tmp_path):
    """DimeNet++'s forces (the catalysis workload's model, CPU-sized) move ~200 MiB a frame in
    their memory-bound operators (bases, masks, messages) against ~0.16 GFLOP of matrix products:
    the planner's step time is mostly `memory_traffic`, the bytes of the rank's frames over the
    system's elementwise bandwidth per core times the rank's cores."""
    import exatrain as et
    from exatrain.models import DimeNetPlusPlus, Forces
    from exatrain.tune.spec import user_spec

    model = Forces(DimeNetPlusPlus(hidden=32, blocks=2, int_emb=16, basis_emb=8, out_emb=32,
                                   cutoff=6.0, max_z=80))
    torch.manual_seed(0)
    frame = torch.cat([torch.randint(1, 30, (1, 20, 1)).float(), torch.randn(1, 20, 3) * 3], -1)

    def loss(forces):
        return forces.abs().mean()
    spec = user_spec(model, frame, loss)
    assert 100 * 2 ** 20 < spec.traffic_bytes_per_sample < 400 * 2 ** 20, spec.traffic_bytes_per_sample
    # what a step moves whatever its batch is of the order of its weights (41.7 k: gradients
    # and their sums; measured 2.9 × their bytes), not of its frames
    assert spec.traffic_bytes_per_step < 4 * 4 * spec.params, spec.traffic_bytes_per_step
    system = two_core_system(tmp_path)
    for world, threads in ((1, 2), (2, 1)):
        (best,) = [p for p in et.plans(model, frame, world=world, batch=16, loss=loss,
                                       system=str(system)) if p["degrees"].get("data", 1) == world
                   and p["degrees"].get("shard", 1) == 1]
        parts = best["time_parts_s"]
        expected = (spec.traffic_bytes_per_sample * 16 / world + spec.traffic_bytes_per_step) \
            / (1e10 * threads)
        assert abs(parts["memory_traffic"] / expected - 1) < 1e-9, (parts, expected)
        assert parts["memory_traffic"] > parts["compute"], parts


class TokenRegressor(nn.Module):
    """A user's model over tokens: an embedding table, a mean over the sequence, a head."""

    def __init__(self, vocab: int, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, 8)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def test_an_embedding_is_charged_the_rows_it_reads_and_its_dense_gradient_once_a_step(tmp_path):
    """An embedding lookup reads the rows of its tokens, not its table, so a sample's bytes do
    not grow with the vocabulary; the table's dense gradient (written whole by the backward) is
    moved once a step whatever the batch, not once a sample: the step time charges
    per-sample bytes × the rank's batch + per-step bytes. (Charged whole per sample, a table of
    50,000 × 256 predicted a CPU step 5 × too long.)"""
    import exatrain as et
    from exatrain.tune.spec import user_spec

    tokens = torch.randint(0, 1000, (1, 32))
    small, large = (user_spec(TokenRegressor(vocab), tokens) for vocab in (1000, 50000))
    assert small.traffic_bytes_per_sample == large.traffic_bytes_per_sample, (small, large)
    assert large.traffic_bytes_per_sample < 64 * 1024, large.traffic_bytes_per_sample
    table = 50000 * 64 * 4
    assert table <= large.traffic_bytes_per_step < 1.1 * table, large.traffic_bytes_per_step
    system = two_core_system(tmp_path)
    for world, threads in ((1, 2), (2, 1)):
        (best,) = [p for p in et.plans(TokenRegressor(50000), tokens, world=world, batch=64,
                                       system=str(system))
                   if p["degrees"].get("data", 1) == world and p["degrees"].get("shard", 1) == 1]
        expected = (large.traffic_bytes_per_sample * 64 / world + large.traffic_bytes_per_step) \
            / (1e10 * threads)
        assert abs(best["time_parts_s"]["memory_traffic"] / expected - 1) < 1e-9, best


def test_a_loss_bound_to_one_samples_target_is_planned_at_batch_1_with_a_warning():
    """A loss closed over one sample's target cannot take the batches of 2 and 4 the bytes are
    traced at: the planner says so and charges batch 1's bytes per sample (the table whole)
    rather than failing; the model's buffers (a BatchNorm's batch count) are as they were."""
    import exatrain as et
    from exatrain.tune.spec import user_spec

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = nn.Embedding(5000, 16), nn.BatchNorm1d(16)
            self.head = nn.Linear(16, 10)

        def forward(self, tokens):
            return self.head(self.norm(self.embed(tokens).transpose(1, 2)).mean(2))

    model, tokens, label = Classifier(), torch.randint(0, 5000, (1, 8)), torch.tensor([3])
    with pytest.warns(UserWarning, match="traced Classifier at batch 1 only: at batch 2 its "
                                         "forward or loss raised"):
        spec = user_spec(model, tokens, lambda out: F.cross_entropy(out, label))
    assert spec.traffic_bytes_per_step == 0 and spec.traffic_bytes_per_sample > 5000 * 16 * 4
    assert model.norm.num_batches_tracked == 0
    # a loss of any batch: the table's gradient once a step, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranked = et.plans(model, tokens, world=1, batch=8,
                          loss=lambda out: F.cross_entropy(out, label.expand(len(out))))
    assert ranked and spec.traffic_bytes_per_sample > 40 * user_spec(
        model, tokens, lambda out: F.cross_entropy(out, label.expand(len(out)))
    ).traffic_bytes_per_sample


FLAT_LOGITS_SCRIPT = '''
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import exatrain as et

class LM(nn.Module):
    """Next-token logits flattened over batch and sequence: (B*T, V)."""
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, tokens):
        return self.head(self.embed(tokens)).view(-1, 50)

tokens = torch.randint(0, 50, (32, 17))
et.fit(LM, TensorDataset(tokens[:24, :-1], tokens[:24, 1:]), TensorDataset(tokens[24:, :-1],
       tokens[24:, 1:]), loss=lambda out, y: F.cross_entropy(out, y.reshape(-1)),
       train={"batch_size": 8})
'''


def test_exatrain_plan_gives_a_scripts_loss_its_target_at_each_traced_batch(tmp_path):
    """`exatrain plan SCRIPT`: the script's loss gets the first sample's target repeated to the
    batch the model was given, whatever the output's shape (logits flattened over batch and
    sequence here), so the bytes are traced at batches 2 and 4 without a warning."""
    import json

    from exatrain.cli import main
    script = tmp_path / "lm.py"
    script.write_text(FLAT_LOGITS_SCRIPT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["plan", str(script), "--world", "1", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["ranked"]


def test_a_model_whose_batchnorm_needs_two_samples_is_planned_per_sample():
    """A BatchNorm over features (N, C) cannot train on one sample (torch: "Expected more than
    1 value per channel"): the model is traced at batch 2 and its figures halved, so its FLOPs
    per sample are the same model's without the norm, and it is planned."""
    import exatrain as et
    from exatrain.tune.spec import user_spec

    def mlp(norm):
        return nn.Sequential(nn.Linear(16, 32), norm, nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(8, 16)
    normed, plain = user_spec(mlp(nn.BatchNorm1d(32)), x), user_spec(mlp(nn.Identity()), x)
    # forward 2·(16·32 + 32), backward the weights' as much and the second layer's input's
    assert normed.flops_per_sample == plain.flops_per_sample == 2 * 2 * (16 * 32 + 32) + 2 * 32
    # what the norm saves: its input, its output (the ReLU's input) and its statistics
    assert normed.act_bytes_per_sample == plain.act_bytes_per_sample + 4 * (32 + 32 + 2 * 32 / 2)
    model = mlp(nn.BatchNorm1d(32))
    assert et.plans(model, x, world=2, batch=32)
    assert model[1].num_batches_tracked == 0


def test_the_planners_traces_leave_a_models_buffers_as_they_were():
    """A forward that assigns a buffer anew (a running average kept by hand) or sets one that
    was None: after `et.plans` the model holds its own real tensors and values, not the
    trace's fake ones, and trains as before."""
    import exatrain as et
    from torch._subclasses.fake_tensor import FakeTensor

    class Smoothed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)
            self.register_buffer("average", torch.zeros(4))
            self.register_buffer("last", None)

        def forward(self, x):
            self.average = 0.9 * self.average + 0.1 * x.mean(0)
            self.last = x[:1]
            return self.linear(x - self.average)

    model = Smoothed()
    average = model.average
    assert et.plans(model, torch.randn(3, 4), world=1, batch=8)
    assert model.average is average and not isinstance(model.average, FakeTensor)
    assert model.average.abs().sum() == 0 and model.last is None
    model(torch.ones(2, 4)).sum().backward()
    assert torch.allclose(model.average, torch.full((4,), 0.1))
