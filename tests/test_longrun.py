"""Long runs: restarts after kills, a hang, wall-time stops, verified checkpoints, export,
failure policies, and errors that tell user input from bugs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from exatrain.cli import main
from exatrain.train.checkpoints import checkpoint
from exatrain.train.checkpoints.export import export_run, load_initial_weights, read_state_dict
from exatrain.train.resilience.faults import ENV
from exatrain.train.run import run_job, setup
from harness import run_ranks


def test_bench_faults_kills_restart_bit_identical_and_a_hang_is_named(tmp_path, capsys):
    """Three SIGKILLs at seeded random steps (the second inside a checkpoint write) under
    restarts: the final weights equal an uninterrupted run's byte for byte. A rank that never
    joins a collective: every rank exits within timeout + 30 s and the flight records name the
    operation, the axis and the rank that did not arrive."""
    out = tmp_path / "faults.json"
    assert main(["bench", "faults", "--json", str(out), "--kills", "3", "--steps", "12",
                 "--timeout", "5"]) == 0
    r = json.loads(out.read_text())
    for key in ("kills", "restarts", "lost_steps", "final_weights_equal", "hang_detect_s",
                "timeout_s", "checkpoint_s", "checkpoint_s_async", "checkpoint_bytes"):
        assert key in r, key
    assert r["kills"] == r["restarts"] == 3 and "kill_in_save" in r["kill_plan"]
    assert r["final_weights_equal"] is True
    assert r["lost_steps"] >= 0 and r["checkpoint_bytes"] > 0
    assert r["hang_detect_s"] <= r["timeout_s"] + 30
    assert r["flight_records"] == "rank0.json,rank1.json"
    # the first collective of step 3 on the data axis: BatchNorm's statistics in the forward
    assert "all_gather on mesh axis 'data' (tag batchnorm" in r["hang_diagnosis"]
    assert "rank(s) [1] did not arrive" in r["hang_diagnosis"]


def _run_with_faults(faults: str, config, resume=None):
    os.environ[ENV] = faults
    try:
        return run_job(config, resume)
    finally:
        del os.environ[ENV]


def test_sigterm_checkpoints_stops_cleanly_and_resumes(tiny_config, tmp_path):
    config = tiny_config("train.steps=6", "train.checkpoint_every=0", "train.eval_every=0")
    stopped = run_ranks(2, _run_with_faults, "term@1:3", config)[0]
    run_dir = Path(stopped["run_dir"])
    assert stopped["stopped_by_signal"] and stopped["steps"] == 3
    assert checkpoint.latest(run_dir).name == "step_00000003"
    resumed = run_ranks(2, run_job, config, str(run_dir))[0]
    assert resumed["steps"] == 6 and not resumed["stopped_by_signal"]
    steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == [1, 2, 3, 4, 5, 6]  # no line twice

    # a flipped byte or a truncated file is refused by the manifest, naming the file
    for damage in ("flip", "truncate"):
        copy = tmp_path / damage
        shutil.copytree(run_dir, copy)
        last = checkpoint.latest(copy)
        victim = sorted(last.glob("*.distcp"))[0]
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        else:
            data = data[:-7]
        victim.write_bytes(bytes(data))
        with pytest.raises(checkpoint.CheckpointError, match=victim.name):
            checkpoint.verify(last)
        with pytest.raises(checkpoint.CheckpointError, match=victim.name):
            export_run(copy, tmp_path / f"{damage}.safetensors")
    manifest = checkpoint.verify(checkpoint.latest(run_dir))
    assert manifest["step"] == 6 and manifest["torch"] == torch.__version__
    assert manifest["config_sha256"] and manifest["plan"] == "Plan(data=2)"
    assert all(len(t["crc32"]) == 1 for t in manifest["tensors"].values())


def _train_and_export_weights(degrees: dict, run_dir: str, overrides=()) -> None:
    from test_tensor_training import config_for, make_workload

    from exatrain.mesh import init
    from exatrain.parallel import parallelize
    from exatrain.plan import Plan
    from exatrain.train.trainer import Trainer

    mesh = init(Plan(**degrees))
    try:
        config = config_for("sgd", 8, *overrides)
        workload = make_workload("gpt")
        model = parallelize(workload.model, mesh, config.parallel)
        Trainer(mesh, workload, config, model, run_dir=Path(run_dir)).fit()
    finally:
        if degrees == {}:
            mesh.close()


def test_export_under_tensor_and_zero3_equals_serial(tmp_path, one_thread):
    (tmp_path / "serial").mkdir()
    _train_and_export_weights({}, str(tmp_path / "serial"))
    (tmp_path / "tp").mkdir()
    run_ranks(4, _train_and_export_weights, dict(data=2, tensor=2), str(tmp_path / "tp"))
    (tmp_path / "zero3").mkdir()
    run_ranks(2, _train_and_export_weights, dict(shard=2), str(tmp_path / "zero3"),
              ("parallel.zero_stage=3",))
    files = {}
    for name in ("serial", "tp", "zero3"):
        export_run(tmp_path / name, tmp_path / f"{name}.safetensors")
        files[name] = read_state_dict(tmp_path / f"{name}.safetensors")
    for name in ("tp", "zero3"):
        assert files[name].keys() == files["serial"].keys()
        for key, ref in files["serial"].items():
            assert files[name][key].shape == ref.shape and files[name][key].dtype == ref.dtype
            # rel 1e-5 (fp32, exact algorithm); atol for the key biases, which are rounding
            # noise in every run (see test_tensor_training)
            torch.testing.assert_close(files[name][key], ref, rtol=1e-5, atol=1e-6)

    # model.init_from: a run starts from the exported file (and from a plain state dict)
    torch.save({"model": files["tp"]}, tmp_path / "plain.pt")
    from test_tensor_training import make_workload
    for path in (tmp_path / "tp.safetensors", tmp_path / "plain.pt"):
        model = make_workload("gpt").model
        load_initial_weights(model, path)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in files["tp"].items())


def test_failure_policies(tiny_config, tmp_path, one_thread):
    from exatrain.train import NonFiniteLoss
    from exatrain.train.resilience.policies import SkipBadSamples, out_of_memory_advice

    def diverging(trainer, at_step):
        real = trainer.workload.loss_fn
        trainer.workload.loss_fn = lambda out, y: real(out, y) * (
            float("nan") if trainer.step + 1 == at_step else 1.0)

    # skip: the step is dropped, counted, and the run goes on
    mesh, trainer = setup(tiny_config("train.steps=4", "train.on_nonfinite='skip'",
                                      "train.eval_every=0"))
    try:
        diverging(trainer, 2)
        summary = trainer.fit()
        assert summary["steps"] == 4 and summary["nonfinite_skipped"] == 1
        advice = out_of_memory_advice(mesh.plan, trainer.config.parallel, trainer.config.train,
                                      trainer.micro, mesh.rank, trainer.step + 1,
                                      trainer.last_state_bytes.get("total"),
                                      RuntimeError("CUDA out of memory"))
        for hint in ("plan.shard", "zero_stage=3", "activation_checkpointing", "grad_accum",
                     "bf16"):
            assert hint in advice
    finally:
        mesh.close()
    # skip, bounded: the second non-finite step stops the run with its step number
    mesh, trainer = setup(tiny_config("train.steps=4", "train.on_nonfinite='skip'",
                                      "train.max_nonfinite_skips=0"))
    try:
        diverging(trainer, 3)
        with pytest.raises(NonFiniteLoss, match="step 3: loss nan"):
            trainer.fit()
    finally:
        mesh.close()
    # a run that fails before its first step leaves no run directory behind
    config = tiny_config("train.batch_size=48", f"run.out_dir='{tmp_path}/fail'")  # > 42 samples
    with pytest.raises(ValueError, match="larger than the training set"):
        run_job(config)
    assert (tmp_path / "fail").is_dir() and not list((tmp_path / "fail").glob("*"))

    # a corrupt sample: skipped, with its index and error logged
    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 2:
                raise ValueError(f"data.h5: corrupt sample {i}")
            return torch.tensor([float(i)])

    guarded = SkipBadSamples(Samples(), tmp_path, rank=0)
    assert [float(guarded[i]) for i in range(4)] == [0.0, 1.0, 3.0, 3.0]
    logged = [json.loads(l) for l in (tmp_path / "bad_samples.jsonl").read_text().splitlines()]
    assert [(l["index"], "corrupt sample 2" in l["error"]) for l in logged] == [(2, True)]


def test_user_errors_are_one_line_and_bugs_are_called_internal(tmp_path, capsys):
    from exatrain.errors import is_user_error
    from exatrain.models.gpt import GPT, GPTConfig

    assert main(["run", "--set", "train.grad_accum=0", "--set", f"run.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "train.grad_accum=0 is out of range: it accepts whole numbers ≥ 1" in err
    assert main(["run", "--nproc", "1", "--set", "model.size=20", "--set", "data.size=20",
                 "--set", f"data.path={tmp_path}/d", "--set", "data.samples=8",
                 "--set", f"run.out_dir={tmp_path}/runs"]) == 2
    assert "must be divisible" in capsys.readouterr().err
    assert not list((tmp_path / "runs").glob("*"))  # failed before its first step: no run dir
    with pytest.raises(ValueError) as wrong_input:  # the user's batch: named, not internal
        GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=8))(torch.zeros(3))
    assert is_user_error(wrong_input.value) and "(B, T)" in str(wrong_input.value)
    with pytest.raises(RuntimeError) as inside_forward:  # a bug in the model's own arithmetic
        torch.nn.Linear(4, 3)(torch.zeros(2, 5))
    assert not is_user_error(inside_forward.value)
    with pytest.raises(ValueError) as in_constructor:
        GPTConfig(vocab_size=0)
    assert is_user_error(in_constructor.value)


def test_a_lost_peer_is_called_an_echo():
    from exatrain.errors import is_peer_loss, is_user_error

    echo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert is_peer_loss(echo) and not is_user_error(echo)
