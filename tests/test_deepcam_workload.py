"""The DeepCAM workload: loss and metric definitions, and spatial × data training equals serial.

One 4-rank launch checks the segmentation model two ways, under data=2 × space=(1, 1, 2) and under
space=(1, 2, 2) (every rank one quarter of each 48×64 field):

* in float64, one forward and backward: output, input gradient, every weight gradient and the
  BatchNorm running statistics equal the serial model's to 1e-10 (measured ~1e-14): the
  distributed algorithm is exact;
* in float32, three SGD steps with the Trainer: losses within 1e-5 (measured 1e-7) and the
  validation mean IoU within 1e-6 of serial. The weights are compared against the float32 noise
  floor of this model, measured here: the serial model on 1 thread against 2 threads. BatchNorm
  shifts get gradients Σ dy that are almost pure cancellation (the next BatchNorm removes the
  mean), so any change of summation order moves them by ~1e-3 of their tiny size; the spatial
  run must stay within 5× that floor (measured: the same size as the floor).

Dropout is off: its masks are random per rank, so no Plan can reproduce the serial ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from exatrain.data.deepcam_write import write_deepcam
from exatrain.models.deepcam import confusion_matrix, mean_iou, weighted_cross_entropy
from exatrain.parallel import unwrap
from exatrain.train.config import load_config
from exatrain.train.run import setup
from harness import max_rel_err_state, rel_err, run_ranks


@pytest.fixture(scope="module")
def deepcam_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepcam48")
    write_deepcam(path, 24, height=48, width=64, seed=1, val_fraction=0.25)
    return path


def config(path, tmp, *overrides):
    return load_config(None, ["run.workload='deepcam'", "model.variant='small'", "model.width=4", "model.dropout=0.0",
                              f"data.path={path}", "data.generate=false", "train.batch_size=4",
                              "train.log_every=1", f"run.out_dir={tmp}/runs", "train.steps=3",
                              "optim.name='sgd'", "optim.lr=0.05", *overrides])


def _train(cfg) -> dict:
    mesh, trainer = setup(cfg)
    summary = trainer.fit()
    return {"losses": [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]],
            "state": {k: v.detach().cpu().clone()
                      for k, v in unwrap(trainer.model).state_dict().items()},
            "summary": summary, "mesh": mesh}


def _float64_step(mesh) -> float:
    """Largest relative error of one DeepCAM forward/backward in float64 against serial."""
    from exatrain.comm import all_reduce
    from exatrain.models.deepcam import DeepCAM
    from exatrain.parallel.spatial import gather_output, parallelize_spatial, split_input

    torch.manual_seed(0)
    serial = DeepCAM(width=4, dropout=0.0).double()
    dist = parallelize_spatial(serial, mesh)
    replicas, r = mesh.axis("data").size, mesh.axis("data").rank
    x = torch.randn(2 * replicas, 16, 48, 64, dtype=torch.float64, requires_grad=True)
    y = serial(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    rows = slice(2 * r, 2 * r + 2)
    xb = split_input(x.detach()[rows], mesh).requires_grad_()
    yb = dist(xb)
    (yb * split_input(g[rows], mesh)).sum().backward()
    errs = [rel_err(gather_output(yb.detach(), mesh), y[rows]),
            rel_err(gather_output(xb.grad, mesh), x.grad[rows])]
    for p, q in zip(dist.parameters(), serial.parameters()):
        grad = p.grad.clone()
        all_reduce(grad, mesh.axis("data", "space"))
        errs.append(rel_err(grad, q.grad))
    errs += [rel_err(b, c) for b, c in zip(dist.buffers(), serial.buffers()) if b.is_floating_point()]
    return max(errs)


def spatial_runs(cfg_a, cfg_b) -> list[dict]:
    from exatrain.mesh import init

    out = []
    for cfg in (cfg_a, cfg_b):
        run = _train(cfg)
        mesh = run.pop("mesh")
        run["bytes_per_step"] = run["summary"]["bytes_per_step"]
        run["float64_err"] = _float64_step(init(mesh.plan))
        out.append(run)
    mesh.close()
    return out


def test_loss_and_metric_definitions(deepcam_data, tmp_path):
    """World size 1: the loss is DeepCAM's weighted mean; the metric sums give mean IoU."""
    from exatrain.workloads.deepcam import build

    cfg = config(deepcam_data, tmp_path)
    mesh, trainer = setup(cfg)
    try:
        workload = build(cfg, mesh)
        torch.manual_seed(0)
        logits = torch.randn(2, 3, 48, 64, requires_grad=True)
        labels = torch.stack([workload.train_set[i][1] for i in range(2)])
        weights = torch.tensor([0.1, 0.3, 0.6])
        assert labels.unique().numel() == 3
        from exatrain.workloads.deepcam import segmentation_loss
        ours = segmentation_loss(weights, mesh)(logits, labels)
        theirs = weighted_cross_entropy(logits, labels, weights)
        assert rel_err(ours, theirs) <= 1e-6
        sums = workload.metric_sums(logits, labels)
        cm = confusion_matrix(logits.argmax(1), labels, 3)
        assert [[float(sums[f"cm_{i}_{j}"]) for j in range(3)] for i in range(3)] == cm.tolist()
        metrics = workload.finalize({k: float(v) for k, v in sums.items()})
        assert metrics["val_mean_iou"] == pytest.approx(mean_iou(logits.argmax(1), labels, 3))
        assert 0 < workload.baselines["baseline_mean_iou"] < 0.5
        assert workload.metric_axes == ("data", "space")
        assert workload.flops_per_sample > 0
    finally:
        mesh.close()


def test_deepcam_space_times_data_equals_serial(deepcam_data, tmp_path):
    runs = run_ranks(4, spatial_runs, config(deepcam_data, tmp_path, "plan.space=[1,1,2]"),
                     config(deepcam_data, tmp_path, "plan.space=[1,2,2]"))
    before = torch.get_num_threads()
    try:
        serial = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            run = _train(config(deepcam_data, tmp_path))
            run.pop("mesh").close()
            serial.append(run)
    finally:
        torch.set_num_threads(before)
    floor = max_rel_err_state(serial[0]["state"], serial[1]["state"])
    serial = serial[0]
    for rank in runs:
        for run in rank:
            assert run["float64_err"] <= 1e-10
            assert len(run["losses"]) == 3
            assert rel_err(torch.tensor(run["losses"]), torch.tensor(serial["losses"])) <= 1e-5
            assert max_rel_err_state(run["state"], serial["state"]) <= 5 * max(floor, 1e-5)
            assert math.isclose(run["summary"]["val_mean_iou"], serial["summary"]["val_mean_iou"],
                                rel_tol=1e-6)
            # halos travel on `space`, BatchNorm statistics on `data+space`
            assert run["bytes_per_step"]["space"] > 0 and run["bytes_per_step"]["data+space"] > 0
