"""CosmoFlow and DeepCAM with channel/filter-parallel convolutions train like serial (the Trainer).

Three SGD steps of the real Trainer (its data, loss, BatchNorm with global statistics) under

  CosmoFlow (16³, 4 conv blocks, 4 -> 32 channels, BatchNorm)
             Plan(tensor=2)                  2 ranks: both conv pairs split
             Plan(data=2, tensor=2)          4 ranks
             Plan(space=(1, 1, 2), tensor=2) 4 ranks: the first three convolutions split over
                                             space, the last over tensor: the switch point of
                                             switch.py's byte rule at the replica's batch of 8
                                             (the Trainer's example), the planner's switch
             Plan(shard=2, tensor=2)         4 ranks, ZeRO-3 (FSDP2) over the split pieces
  DeepCAM    (48×64, width 4, no dropout)
             Plan(tensor=2), Plan(data=2, tensor=2)
             Plan(space=(1, 1, 2), tensor=2) with the switch at 'fuse.0.0' (a segmentation model)

against one process: the three losses and every weight and running statistic (full state dict).
CosmoFlow: relative ≤ 1e-5 (losses), ≤ 1e-4 per tensor, BatchNorm shifts absolute ≤ 1e-5 (measured
3.4e-7, 2.1e-6, 1.1e-8).
DeepCAM's BatchNorm shifts get gradients Σ dy that are near-total cancellation (the next
BatchNorm removes the mean), so any change of summation order moves them by ~1e-2 of their tiny
size (test_deepcam_workload.py), and through them the other weights: its losses and weights must
stay within 5× the float32 floor measured here (serial on 1 against 2 threads: 0 and 1.5e-3;
measured 2.8e-5 and 2e-3 under tensor=2), its shifts within 1e-4 absolute (measured 2.7e-5);
and one float64 step under tensor=2 must equal serial to 1e-10 (measured 1e-14): the algorithm is
exact, the differences are float32 summation order. A checkpoint
written under Plan(tensor=2) at step 2 resumes under Plan(data=2) and serially with the same
losses at steps 3 and 4. DeepCAM under Plan(space=(1, 1, 2), tensor=2): automatically no
convolution is worth splitting at this size (tensor would only replicate the model), which is
refused before training; with the switch moved by `parallel.chanfilt_from` to 'fuse.0.0' (after
the skip connection's torch.cat) it equals serial within the same bounds (measured losses 2.8e-5,
state 2e-3, shifts 2.7e-5; its whole output is cut back into the label blocks, whose gradient
all-gather the ledger counts), and at 'enc2.0.0' (before the skip joins) it is refused naming
the switch and the skip's layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exatrain.data.deepcam_write import write_deepcam
from exatrain.parallel import unwrap
from exatrain.train.config import load_config
from harness import interrupted_copy, logged_losses, max_rel_err_state, rel_err, run_ranks

SGD = ("train.steps=3", "optim.name='sgd'", "optim.lr=0.05", "schedule.warmup_steps=0",
       "train.eval_every=3")
COSMO = ("model.base_channels=4", "model.conv_layers=4", "model.batchnorm=true")


def fit(config) -> dict:
    from exatrain.parallel.tensor.state import full_state_dict
    from exatrain.train.run import setup

    mesh, trainer = setup(config)
    try:
        trainer.fit()
        model = unwrap(trainer.model)
        state = full_state_dict(model) if mesh.plan.tensor_degree > 1 else \
            {k: v.detach().clone() for k, v in model.state_dict().items()}
        tp = getattr(model, "exatrain_tensor", None)
        return {"losses": [l for h in trainer.history if "step_losses" in h
                           for l in h["step_losses"]],
                "state": state, "summary": tp.summary() if tp is not None else {},
                "output_gather": (mesh.ledger.calls_by_axis("output"),
                                  mesh.ledger.bytes_by_axis("output"))}
    finally:
        mesh.close()


def refusal(config) -> str:
    try:
        fit(config)
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return ""


def _check(runs, serial, label, state_tol=1e-4, loss_tol=1e-5, shift_tol=1e-5):
    for r in runs:
        err = rel_err(torch.tensor(r["losses"]), torch.tensor(serial["losses"]))
        assert len(r["losses"]) == 3 and err <= loss_tol, (label, err)
    state = runs[0]["state"]
    assert state.keys() == serial["state"].keys(), label
    shifts = {k for k in state if k.endswith(".bias") and k[:-4] + "running_mean" in state}
    errs = sorted((rel_err(state[k].float(), serial["state"][k].float()), k) for k in state
                  if state[k].is_floating_point() and k not in shifts)
    worst = errs[-1]
    assert worst[0] <= state_tol, (label, errs[-8:])
    # BatchNorm shifts: gradients Σ dy are cancellation noise (module docstring); absolute bound
    drift = max((float((state[k] - serial["state"][k]).abs().max()) for k in shifts), default=0.0)
    assert drift <= shift_tol, (label, drift)
    print(f"{label}: losses {err:.1e}, state {worst[0]:.1e} ({worst[1]}), shifts {drift:.1e}")


def test_cosmoflow_under_tensor_data_and_space(tiny_config):
    serial = fit(tiny_config(*SGD, *COSMO))
    for ranks, case in ((2, ("plan.tensor=2",)), (4, ("plan.data=2", "plan.tensor=2")),
                        (4, ("plan.space=[1,1,2]", "plan.tensor=2")),
                        (4, ("plan.shard=2", "plan.tensor=2", "parallel.zero_stage=3"))):
        runs = run_ranks(ranks, fit, tiny_config(*SGD, *COSMO, *case))
        _check(runs, serial, case)
        pairs = runs[0]["summary"]["conv_pairs"]
        if "plan.space=[1,1,2]" in case:   # the byte rule's switch, not the 90 %-of-weights one
            assert pairs == [] and runs[0]["summary"]["conv_gathered"] == ["features.12"], pairs
        else:
            assert pairs == [["features.0", "features.4"], ["features.8", "features.12"]], pairs


@pytest.fixture(scope="module")
def deepcam_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepcam48c")
    write_deepcam(path, 24, height=48, width=64, seed=1, val_fraction=0.25)
    return path


def deepcam(path, tmp, *overrides):
    # one memory layout in every run: the serial reference would otherwise run channels-last
    # convolutions (parallel/layout.py) and the split ones contiguous ones, whose float32
    # rounding differs by more than this model's noise floor
    return load_config(None, ["run.workload='deepcam'", "model.variant='small'", "model.width=4", "model.dropout=0.0",
                              "parallel.channels_last='off'",
                              f"data.path={path}", "data.generate=false", "train.batch_size=4",
                              "train.log_every=1", f"run.out_dir={tmp}/runs", *SGD, *overrides])


def deepcam_float64_step() -> float:
    """Largest relative error of DeepCAM's weight gradients and running statistics after one
    float64 forward/backward under Plan(tensor=2), against serial."""
    import copy

    from exatrain.mesh import init
    from exatrain.models.deepcam import DeepCAM
    from exatrain.parallel import parallelize
    from exatrain.parallel.tensor.state import full_state_dict, gather_full, layout_of
    from exatrain.plan import Plan

    mesh = init(Plan(tensor=2))
    torch.manual_seed(0)
    plain = DeepCAM(in_channels=16, width=4, dropout=0.0).double()
    serial = copy.deepcopy(plain)
    par = parallelize(plain, mesh)
    x = torch.randn(2, 16, 48, 64, dtype=torch.float64)
    w = torch.randn(2, 3, 48, 64, dtype=torch.float64)
    (par(x) * w).sum().backward()
    (serial(x) * w).sum().backward()
    grads = {n: gather_full(p.grad, layout_of(p)) for n, p in par.named_parameters()}
    errs = [rel_err(grads[n], p.grad) for n, p in serial.named_parameters()]
    full = full_state_dict(par)
    errs += [rel_err(full[k], v) for k, v in serial.state_dict().items() if v.is_floating_point()]
    mesh.close()
    return max(errs)


def test_deepcam_under_tensor_and_data(deepcam_data, tmp_path):
    for err in run_ranks(2, deepcam_float64_step):   # the algorithm is exact (measured 1e-14)
        assert err <= 1e-10, err
    before = torch.get_num_threads()
    try:  # the float32 noise floor of this model: serial on 1 thread against 2 threads
        serial = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            serial.append(fit(deepcam(deepcam_data, tmp_path)))
    finally:
        torch.set_num_threads(before)
    loss_floor = rel_err(torch.tensor(serial[0]["losses"]), torch.tensor(serial[1]["losses"]))
    state_floor = max_rel_err_state(serial[0]["state"], serial[1]["state"])
    print(f"DeepCAM float32 floor: losses {loss_floor:.1e}, state {state_floor:.1e}")
    for ranks, case in ((2, ("plan.tensor=2",)), (4, ("plan.data=2", "plan.tensor=2"))):
        runs = run_ranks(ranks, fit, deepcam(deepcam_data, tmp_path, *case))
        _check(runs, serial[0], case, state_tol=5 * max(state_floor, 1e-5),
               loss_tol=5 * max(loss_floor, 1e-5), shift_tol=1e-4)
        assert runs[0]["summary"]["conv_pairs"], runs[0]["summary"]
    # space × tensor: at this batch the byte rule splits no convolution (space moves fewer bytes
    # in every one), so no layer is left for tensor: refused with the two fixes
    space = ("plan.space=[1,1,2]", "plan.tensor=2")
    for m in run_ranks(4, refusal, deepcam(deepcam_data, tmp_path, *space)):
        assert "no layer is left for the tensor axis" in m and "chanfilt_from" in m, m
    # the switch moved by hand past the skip join (the torch.cat): the blocks are gathered
    # before 'fuse.0.0', the output is cut back into blocks; equal to serial
    runs = run_ranks(4, fit, deepcam(deepcam_data, tmp_path, *space,
                                     "parallel.chanfilt_from='fuse.0.0'"))
    _check(runs, serial[0], space, state_tol=5 * max(state_floor, 1e-5),
           loss_tol=5 * max(loss_floor, 1e-5), shift_tol=1e-4)
    assert runs[0]["summary"]["conv_pairs"] == [["fuse.0.0", "fuse.1.0"]], runs[0]["summary"]
    # the output gradient's all-gather over space, once per training step: N·C_out·H·W·4 bytes
    for r in runs:
        assert r["output_gather"] == ({"space": 3}, {"space": 3 * 4 * 3 * 48 * 64 * 4}), r
    # ... and before it, at 'enc2.0.0': the skip (enc1's output, on blocks) would meet the whole
    # upsampled ASPP output; refused naming the switch, the layer and the fix
    moved = deepcam(deepcam_data, tmp_path, *space, "parallel.chanfilt_from='enc2.0.0'")
    for m in run_ranks(4, refusal, moved):
        assert m.startswith("SpatialSplitError") and "'enc2.0.0'" in m and "'skip_proj.0'" in m \
            and "chanfilt_from to a convolution after the skip joins" in m, m


def test_checkpoint_from_tensor_resumes_under_data_and_serially(tiny_config, tmp_path):
    from exatrain.train.run import run_job

    common = ("train.steps=4", "train.checkpoint_every=2", "train.checkpoint_keep=3", *COSMO,
              "optim.name='sgd'", "optim.lr=0.05", "schedule.warmup_steps=0")
    full = Path(run_ranks(2, run_job, tiny_config(*common, "plan.tensor=2"))[0]["run_dir"])
    expected = logged_losses(full)
    for name, ranks, overrides in (("data", 2, ("plan.data=2",)), ("serial", 1, ())):
        cut = interrupted_copy(full, tmp_path / name, stopped_at=2, later=4)
        config = tiny_config(*common, *overrides)
        if ranks == 1:
            run_job(config, str(cut))
        else:
            run_ranks(ranks, run_job, config, str(cut))
        resumed = logged_losses(cut)
        for step in (3, 4):
            assert resumed[step] == pytest.approx(expected[step], rel=1e-5), (name, step)
