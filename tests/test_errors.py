"""Bad input gets a clear error, and nothing is lost."""

from __future__ import annotations

import pytest

from exatrain.cli import main
from exatrain.train import NonFiniteLoss
from exatrain.train.checkpoints import checkpoint
from exatrain.train.run import setup


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tiny_config):
    mesh, trainer = setup(tiny_config("train.steps=6", "train.checkpoint_every=2"))
    try:
        real_loss = trainer.workload.loss_fn

        def loss_that_diverges_at_step_3(output, target):
            loss = real_loss(output, target)
            return loss * float("nan") if trainer.step == 3 else loss

        trainer.workload.loss_fn = loss_that_diverges_at_step_3
        with pytest.raises(NonFiniteLoss, match=r"step 4: loss nan.*step_00000002") as info:
            trainer.fit()
        assert "Lower optim.lr" in str(info.value)
        last = checkpoint.latest(trainer.run_dir)
        assert last is not None and last.name == "step_00000002"
        assert not list(last.parent.glob("*.partial"))
    finally:
        mesh.close()


def test_missing_data_names_the_path_and_the_command(tmp_path, capsys):
    code = main(["run", "--nproc", "1", "--set", f"data.path={tmp_path}/nothing",
                 "--set", "data.generate=false", "--set", f"run.out_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{tmp_path}/nothing" in err and "exatrain data cosmoflow --out DIR" in err


def test_corrupt_data_file_is_named(tmp_path, capsys):
    (tmp_path / "train.h5").write_bytes(b"this is not HDF5")
    (tmp_path / "val.h5").write_bytes(b"nor this")
    code = main(["run", "--nproc", "1", "--set", f"data.path={tmp_path}",
                 "--set", "data.generate=false", "--set", f"run.out_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2 and "train.h5" in err and "sample 0" in err


def test_plan_that_does_not_fit_is_refused_before_any_rank_starts(tmp_path, capsys):
    code = main(["run", "--nproc", "2", "--set", "plan.data=3", "--set", f"run.out_dir={tmp_path}/runs"])
    err = capsys.readouterr().err
    assert code == 2 and "needs 3 ranks but the job has 2" in err and "Use data=2" in err
    assert not (tmp_path / "runs").exists()


def test_resume_of_a_directory_without_checkpoint(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_flat_mlperf_directory_names_the_layouts_and_what_it_holds(tmp_path, capsys):
    """data.path at a flat directory of MLPerf per-sample .hdf5 files (one split, no train/ and
    validation/): the error lists the accepted layouts and what the directory holds, and nothing
    is generated beside the user's files."""
    flat = tmp_path / "cosmoUniverse"
    flat.mkdir()
    for i in range(3):
        (flat / f"univ_ics_{i:03d}.hdf5").write_bytes(b"")
    for generate in ("true", "false"):
        code = main(["run", "--nproc", "1", "--set", f"data.path={flat}",
                     "--set", f"data.generate={generate}", "--set", f"run.out_dir={tmp_path}/runs"])
        err = " ".join(capsys.readouterr().err.split())   # rich wraps long lines
        assert code == 2
        assert "Accepted layouts" in err and "DIR/train/ and DIR/validation/" in err, err
        assert "DIR/train.h5 and DIR/val.h5" in err and "NAME_data.npy" in err
        assert "holds 3 .hdf5 file(s) (univ_ics_000.hdf5, univ_ics_001.hdf5, univ_ics_002.hdf5)" \
            in err, err
        assert f"move them into {flat}/train/" in err
        assert sorted(p.name for p in flat.iterdir()) == [f"univ_ics_{i:03d}.hdf5" for i in range(3)]
