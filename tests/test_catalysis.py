"""The catalysis workload (MLPerf HPC's OpenCatalyst task, S2EF): its frames are EMT relaxations
of adsorbates on metal patches, recomputed here with ASE; its forces are minus the gradient of
DimeNet++'s energy (finite differences, rotation, padding); it trains equal to serial under
data=2 and shard=2 with ZeRO-2, FSDP2's ZeRO-3 is refused by name before the first step, and
a short run learns forces better than predicting none."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="session")
def catalysis_dir(tmp_path_factory):
    """48 relaxations of 4 frames (192 frames; ~2 s)."""
    from exatrain.data.catalysis import write_catalysis

    path = tmp_path_factory.mktemp("catalysis")
    write_catalysis(path, systems=48, frames=4, seed=1)
    return path


def test_frames_are_emt_relaxations_of_adsorbates_on_a_metal_patch(catalysis_dir):
    """Five stored frames, across relaxations, recomputed with EMT at their stored positions
    (float32 Å): the same forces (to 1e-5 eV/Å) and energy. In every relaxation the 9 fixed
    atoms are the lower layer (below every other metal atom), never move, and the free atoms
    do; its frames follow each other (the energy falls from the first frame to the last)."""
    from ase import Atoms
    from ase.calculators.emt import EMT

    from exatrain.data.catalysis import METALS, load_catalysis

    arrays = load_catalysis(catalysis_dir)
    assert len(arrays["energy"]) == 192 and arrays["z"].shape == (192, 20)
    metals = {Atoms(m).numbers[0] for m in METALS}
    for frame in (0, 5, 17, 46, 191):
        n = int((arrays["z"][frame] > 0).sum())
        assert n in (19, 20) and set(arrays["z"][frame, :18]) <= metals
        atoms = Atoms(arrays["z"][frame, :n], positions=arrays["pos"][frame, :n].astype(np.float64))
        atoms.calc = EMT()
        assert np.abs(atoms.get_forces() - arrays["forces"][frame, :n]).max() < 1e-5
        assert atoms.get_potential_energy() == pytest.approx(arrays["energy"][frame], abs=1e-9)
        assert arrays["free"][frame, :n].sum() == n - 9        # the lower layer of 3 × 3
    for system in range(48):
        frames = np.flatnonzero(arrays["system"] == system)
        assert len(frames) == 4
        fixed = ~arrays["free"][frames[0]] & (arrays["z"][frames[0]] > 0)
        metal = np.isin(arrays["z"][frames[0]], list(metals)) & ~fixed
        pos = arrays["pos"][frames]
        assert fixed.sum() == 9 and pos[0, fixed, 2].max() < pos[0, metal, 2].min() - 1.0
        assert np.array_equal(pos[:, fixed], np.broadcast_to(pos[0, fixed], pos[:, fixed].shape))
        free = arrays["free"][frames[0]]
        assert np.abs(pos[-1, free] - pos[0, free]).max() > 1e-3
        assert arrays["energy"][frames[-1]] < arrays["energy"][frames[0]]


def test_forces_are_minus_the_energy_gradient_rotate_with_the_structure_and_vanish_on_padding():
    """A float64 DimeNet++ (output layers not zero) under `Forces`: each force equals the
    central finite difference of the energy (step 1e-6 Å, to 1e-8); rotating and translating
    the structure rotates the forces (1e-10); padding slots get exact zeros; in evaluation the
    forces are detached, in training they carry the graph to the weights."""
    from exatrain.models.dimenet import DimeNetPlusPlus
    from exatrain.models.forces import Forces

    torch.manual_seed(0)
    energy = DimeNetPlusPlus(hidden=8, blocks=2, int_emb=4, basis_emb=3, out_emb=6, radial=3,
                             spherical=4, cutoff=3.0, max_z=80).double()
    for output in energy.outputs:
        torch.nn.init.normal_(output.out.weight, std=0.3)
    model = Forces(energy).eval()
    atoms = torch.zeros(2, 6, 4, dtype=torch.float64)
    atoms[0, :5, 0] = torch.tensor([29.0, 29, 78, 8, 1])
    atoms[0, :5, 1:] = torch.randn(5, 3) * 1.2
    atoms[1, :4, 0] = torch.tensor([79.0, 6, 8, 1])
    atoms[1, :4, 1:] = torch.randn(4, 3) * 1.2
    with torch.no_grad():
        forces = model(atoms)
    assert forces.requires_grad is False and forces.shape == (2, 6, 3)
    assert torch.equal(forces[0, 5], torch.zeros(3)) and torch.equal(forces[1, 4:], torch.zeros(2, 3))
    assert forces.abs().max() > 1e-3
    step = 1e-6
    for b, i, c in [(0, 0, 0), (0, 3, 2), (0, 4, 1), (1, 0, 1), (1, 2, 0), (1, 3, 2)]:
        up, down = atoms.clone(), atoms.clone()
        up[b, i, 1 + c] += step
        down[b, i, 1 + c] -= step
        with torch.no_grad():
            difference = -(energy(up)[b] - energy(down)[b]) / (2 * step)
        assert float(forces[b, i, c]) == pytest.approx(float(difference), abs=1e-8)
    a, b_ = 0.7, -1.1
    rz = torch.tensor([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]],
                      dtype=torch.float64)
    rx = torch.tensor([[1, 0, 0], [0, math.cos(b_), -math.sin(b_)], [0, math.sin(b_), math.cos(b_)]],
                      dtype=torch.float64)
    rotation = rz @ rx
    moved = atoms.clone()
    present = atoms[..., :1] > 0
    moved[..., 1:] = torch.where(present, atoms[..., 1:] @ rotation.T + torch.tensor([1.0, -2, 0.5]),
                                 atoms[..., 1:])
    with torch.no_grad():
        assert torch.allclose(model(moved), forces @ rotation.T, atol=1e-10)
    model.train()
    trained = model(atoms)
    trained.pow(2).sum().backward()
    assert energy.outputs[1].out.weight.grad.abs().max() > 0


def _config(catalysis_dir, out_dir, *overrides):
    from exatrain.train.config import load_config

    return load_config(EXAMPLES / "catalysis.toml", [
        f"data.path={catalysis_dir}", "data.generate=false", "data.val_systems=8",
        "model.features=8", "model.interactions=1", "model.int_emb=4", "model.basis_emb=3",
        "model.out_emb=8", "model.radial=3", "model.spherical=3", "model.cutoff=4.0",
        "train.steps=3", "train.batch_size=6", "train.eval_every=0", "train.checkpoint_every=0",
        "train.log_every=1", "optim.name='sgd'", "optim.lr=0.01", "schedule.warmup_steps=0",
        "run.nproc=1", f"run.out_dir={out_dir}", *overrides])


def test_trains_equal_to_serial_under_data_and_zero2_and_zero3_is_refused(catalysis_dir, tmp_path,
                                                                           one_thread):
    """Three SGD steps (momentum) of 6 frames: the losses and the final weights (relative 1e-5
    per tensor; measured 6.9e-8 and 4.5e-7) of data=2 and of shard=2 with ZeRO-2 equal one
    process's, and so does the validation force MAE (measured 2.2e-8). shard=2 with FSDP2
    (ZeRO-3, the default) cannot differentiate twice: refused before the first step, naming
    zero_stage 2 and not the tensor axis (DimeNet++ refuses it)."""
    from exatrain.errors import ParallelizeError
    from harness import max_rel_err_state, rel_err, run_ranks
    from test_dimenet import train_and_report

    serial = train_and_report(_config(catalysis_dir, tmp_path / "serial"))
    assert len(serial["losses"]) == 3 and serial["losses"][0] > 0.1
    # it trained: the output weights, zero at the start (the paper's initialisation), moved
    outputs = [v for k, v in serial["state"].items() if k.endswith("out.weight")]
    assert len(outputs) == 2 and min(float(v.abs().max()) for v in outputs) > 5e-5
    for overrides in (["plan.data=2"], ["plan.shard=2", "parallel.zero_stage=2"]):
        ranks = run_ranks(2, train_and_report, _config(catalysis_dir, tmp_path / overrides[0],
                                                       *overrides), timeout_s=240)
        for result in ranks:
            assert result["summary"]["world_size"] == 2
            assert rel_err(torch.tensor(result["losses"]),
                           torch.tensor(serial["losses"])) <= 1e-5, overrides
            assert max_rel_err_state(result["state"], serial["state"]) <= 1e-5, overrides
            assert result["summary"]["val_forces_mae"] == pytest.approx(
                serial["summary"]["val_forces_mae"], rel=1e-5)
    with pytest.raises(Exception) as refused:
        run_ranks(2, train_and_report, _config(catalysis_dir, tmp_path / "zero3", "plan.shard=2"),
                  timeout_s=240)
    original = getattr(refused.value, "original", refused.value)
    assert isinstance(original, ParallelizeError), original
    assert "parallel.zero_stage=2 (or 1) trains it" in str(original), original
    assert "1D tensor" not in str(original)          # DimeNet++ refuses the tensor axis itself


def test_schnet_in_dimenets_place_trains_equal_to_serial_under_data(catalysis_dir, tmp_path,
                                                                    one_thread):
    """model.name = "schnet": SchNet's energy (a sum over atoms) under `Forces`, its last bias
    frozen (a constant per atom moves no force, so data parallelism would find it unused):
    three SGD steps under data=2 equal one process's (relative 1e-5)."""
    from harness import max_rel_err_state, rel_err, run_ranks
    from test_dimenet import train_and_report

    schnet = ["model.name='schnet'", "model.rbf=8"]
    serial = train_and_report(_config(catalysis_dir, tmp_path / "serial", *schnet))
    ranks = run_ranks(2, train_and_report, _config(catalysis_dir, tmp_path / "data",
                                                   *schnet, "plan.data=2"), timeout_s=240)
    for result in ranks:
        assert rel_err(torch.tensor(result["losses"]), torch.tensor(serial["losses"])) <= 1e-5
        assert max_rel_err_state(result["state"], serial["state"]) <= 1e-5


def test_a_short_run_learns_forces_better_than_predicting_none(catalysis_dir, tmp_path, one_thread):
    """100 AdamW steps (lr 3e-3, batches of 8) of a small DimeNet++ (width 16, one block) on the
    frames of 40 relaxations: the force MAE on the 8 held-out relaxations falls below 0.8 of
    predicting zero forces (measured 0.66)."""
    from exatrain.train.run import setup

    config = _config(catalysis_dir, tmp_path, "train.steps=100", "train.batch_size=8",
                     "optim.name='adamw'", "optim.lr=3e-3", "model.features=16",
                     "model.out_emb=16", "model.cutoff=6.0", "train.log_every=50")
    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
    finally:
        mesh.close()
    assert summary["val_forces_mae"] < 0.8 * summary["baseline_forces_mae"], summary


def test_its_mlperf_log_is_oc20s_and_passes_the_official_checker_but_for_the_target(
        catalysis_dir, tmp_path, one_thread):
    """With `mlperf.enabled` the run's log names MLPerf HPC's benchmark `oc20` and its quality
    key `eval_error` is the validation force MAE; MLPerf's checker (HPC ruleset 3.0.0) passes
    it but for the target (0.036 eV/Å on OC20's DFT forces, which EMT data and 4 steps do not
    reach)."""
    import json

    from exatrain.train.run import setup
    from mlperf_checker import checker_failures

    config = _config(catalysis_dir, tmp_path, "train.steps=4", "train.eval_every=2",
                     "mlperf.enabled=true")
    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
    finally:
        mesh.close()
    log = Path(summary["run_dir"]) / "mlperf.log"
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines()]
    assert [e["value"] for e in events if e["key"] == "submission_benchmark"] == ["oc20"]
    errors = [e["value"] for e in events if e["key"] == "eval_error"]
    assert len(errors) == 2 and errors[-1] == pytest.approx(summary["val_forces_mae"])
    failed, text = checker_failures(log, tmp_path)
    assert failed == ["WARNING -  Failed checks for eval_error : v['value'] <= 0.036 and "
                      "v['value'] > 0."], text


def test_predict_takes_the_first_derivative_under_zero3_as_on_one_rank(catalysis_dir, tmp_path,
                                                                       one_thread):
    """Prediction differentiates once: FSDP2's ZeRO-3, refused for training, predicts the forces
    of a trained model as one rank does (relative 1e-5)."""
    import h5py

    import exatrain as et
    from exatrain.infer.predict import predict
    from exatrain.train.run import setup
    from harness import rel_err, run_ranks
    from test_predict import _predict_rank

    mesh, trainer = setup(_config(catalysis_dir, tmp_path / "runs"))
    try:
        run_dir = trainer.fit()["run_dir"]
    finally:
        mesh.close()
    run_ranks(2, _predict_rank, run_dir, None, str(tmp_path / "zero3.h5"), et.Plan(shard=2))
    predict(run_dir, None, tmp_path / "one.h5", verbose=False)
    with h5py.File(tmp_path / "one.h5") as one, h5py.File(tmp_path / "zero3.h5") as zero3:
        assert zero3.attrs["plan"] == "Plan(shard=2)" and one["predictions"].shape == (32, 20, 3)
        assert float(abs(one["predictions"][...]).max()) > 1e-4
        assert rel_err(torch.from_numpy(zero3["predictions"][...]),
                       torch.from_numpy(one["predictions"][...])) <= 1e-5


def test_data_options_that_cannot_hold_are_refused_naming_the_key(catalysis_dir, tmp_path):
    """A set written earlier with other sizes is not used as if it were the one asked for; a
    validation hold-out as large as the set is refused by name."""
    import shutil

    from exatrain.errors import ConfigError
    from exatrain.train.config import load_config
    from exatrain.workloads import catalysis

    shutil.copy(catalysis_dir / "catalysis.h5", tmp_path / "catalysis.h5")
    config = load_config(EXAMPLES / "catalysis.toml", [f"data.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"holds a catalysis data set of 48 relaxations of 4 "
                                          r"frames \(seed 1\).*data.systems=256"):
        catalysis.prepare(config)
    config = load_config(EXAMPLES / "catalysis.toml", [
        f"data.path={tmp_path}", "data.systems=48", "data.frames=4", "data.seed=1",
        "data.val_systems=48"])
    assert catalysis.prepare(config) == tmp_path              # the set asked for: kept
    with pytest.raises(ConfigError, match=r"data.val_systems=48: .* holds 48 relaxations"):
        catalysis.build(config, None)
    with pytest.raises(ConfigError, match="data.systems=1"):
        load_config(EXAMPLES / "catalysis.toml", ["data.systems=1"])


def test_the_planner_refuses_tensor_plans_for_dimenet_with_its_reason():
    """The planner's verdicts on a traced DimeNet++ forces model (what `exatrain plan SCRIPT`
    ranks by): shard with ZeRO-2 fits; ZeRO-3 and fp8 are refused with training's reasons; a
    tensor Plan is refused with the reason `parallelize` gives, not as a cost it cannot model."""
    from exatrain import Plan
    from exatrain.models import DimeNetPlusPlus, Forces
    from exatrain.tune.layout import Options
    from exatrain.tune.search import shape_problem
    from exatrain.tune.spec import user_spec

    model = Forces(DimeNetPlusPlus(hidden=8, blocks=1, int_emb=4, basis_emb=3, out_emb=8,
                                   radial=3, spherical=3, cutoff=5.0, max_z=80))
    spec = user_spec(model, torch.zeros(1, 20, 4))
    assert spec.extra["differentiates"]
    kind, why = shape_problem(spec, Plan(tensor=2), Options(batch=8))
    assert kind == "not applicable" and "DimeNet++ cannot be split over the tensor" in why
    assert shape_problem(spec, Plan(shard=2), Options(batch=8, zero_stage=2)) is None
    zero3 = shape_problem(spec, Plan(shard=2), Options(batch=8))[1]
    assert "parallel.zero_stage=2" in zero3 and "1D tensor" not in zero3
    assert "parallel.precision='fp8'" in shape_problem(spec, Plan(data=2),
                                                       Options(batch=8, precision="fp8"))[1]
