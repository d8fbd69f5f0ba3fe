"""Data parallelism equals serial training: loss and weights after three steps (relative ≤ 1e-5)."""

from __future__ import annotations

import torch

from exatrain.models import CosmoFlow
from exatrain.parallel import unwrap
from exatrain.train.run import setup
from harness import max_rel_err_state, rel_err, run_ranks


def train_and_report(config) -> dict:
    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
        losses = [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]]
        state = {k: v.detach().cpu().clone() for k, v in unwrap(trainer.model).state_dict().items()}
        grad_bytes = mesh.ledger.bytes_by_axis(tag="grad").get("data", 0)
        bn_bytes = mesh.ledger.bytes_by_axis(tag="batchnorm").get("data", 0)
        n_param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        return {"losses": losses, "state": state, "summary": summary, "grad_bytes": grad_bytes,
                "param_bytes": n_param_bytes, "rank": mesh.rank, "bn_bytes": bn_bytes}
    finally:
        mesh.close()


# the CosmoFlow of conftest.TINY
TINY_MODEL = dict(size=16, conv_layers=4, base_channels=4, batchnorm=True)


def test_data_parallel_equals_serial(tiny_config):
    """SGD with momentum: weights within 1e-5 (measured ~1e-7, the reordering of the gradient sum).

    AdamW is checked too, at 1e-4: its first steps move each weight by ≈ lr·g/(|g| + eps), so a
    gradient component that is zero up to rounding (≈1e-9 here) changes its update by up to
    lr·1e-9/eps when the sum is reordered; measured 2e-5 on 4 ranks with accumulation.
    """
    sgd = ("train.steps=3", "optim.name='sgd'", "optim.lr=0.05")
    # the CosmoFlow here has BatchNorm (statistics over both replicas: the serial batch's);
    # with accumulation BatchNorm sees a micro-batch, serially too, so those cases go without it
    no_bn = ("model.batchnorm=false",)
    serial = train_and_report(tiny_config(*sgd))
    serial_no_bn = train_and_report(tiny_config(*sgd, *no_bn))
    dp2 = run_ranks(2, train_and_report, tiny_config(*sgd))
    dp4_accum = run_ranks(4, train_and_report, tiny_config(*sgd, *no_bn, "train.grad_accum=2"))
    for run, reference in ((dp2, serial), (dp4_accum, serial_no_bn)):
        for rank_result in run:
            assert len(rank_result["losses"]) == 3
            assert rel_err(torch.tensor(rank_result["losses"]), torch.tensor(reference["losses"])) <= 1e-5
            assert max_rel_err_state(rank_result["state"], reference["state"]) <= 1e-5
    adam_serial = train_and_report(tiny_config("train.steps=3", *no_bn))
    adam_dp = run_ranks(4, train_and_report, tiny_config("train.steps=3", *no_bn,
                                                         "train.grad_accum=2"))[0]
    assert rel_err(torch.tensor(adam_dp["losses"]), torch.tensor(adam_serial["losses"])) <= 1e-5
    assert max_rel_err_state(adam_dp["state"], adam_serial["state"]) <= 1e-4
    # the ledger counted exactly the gradient bytes per step on the data axis
    assert dp2[0]["grad_bytes"] == 3 * dp2[0]["param_bytes"]
    # and BatchNorm's statistics travel on it: per layer and step, an all-gather of (count,
    # mean, M2) in float64 from each of the 2 ranks, and an all-reduce of 2C sums in float32
    channels = [m.num_features for m in CosmoFlow(**TINY_MODEL).modules()
                if isinstance(m, torch.nn.BatchNorm3d)]
    assert dp2[0]["bn_bytes"] == 3 * sum(2 * (2 * c + 1) * 8 + 2 * c * 4 for c in channels)
    # per-replica statistics ("replica", DDP's behaviour) send nothing and train another model
    replica = run_ranks(2, train_and_report, tiny_config(*sgd, "parallel.batchnorm='replica'"))[0]
    assert replica["bn_bytes"] == 0
    assert rel_err(torch.tensor(replica["losses"]), torch.tensor(serial["losses"])) > 1e-3
    assert serial["grad_bytes"] == 0
    assert dp2[0]["summary"]["world_size"] == 2 and serial["summary"]["world_size"] == 1


def test_same_seed_same_curve_other_seed_other_curve(tiny_config):
    a = run_ranks(2, train_and_report, tiny_config("train.steps=3", "model.dropout=0.2"))[0]
    b = run_ranks(2, train_and_report, tiny_config("train.steps=3", "model.dropout=0.2"))[0]
    c = train_and_report(tiny_config("train.steps=3", "model.dropout=0.2", "run.seed=5"))
    assert a["losses"] == b["losses"]
    assert max_rel_err_state(a["state"], b["state"]) == 0.0
    assert a["losses"] != c["losses"]


def test_uneven_validation_split_under_zero3_matches_serial(tiny_config):
    """6 validation samples over 4 FSDP ranks (2, 2, 1, 1): every rank must run the same number of
    sharded forwards (the short ones pad and ignore the padding), and the metric equals serial's."""
    sgd = ("train.steps=2", "optim.name='sgd'", "optim.lr=0.05", "train.batch_size=4")  # 1 per rank
    serial = train_and_report(tiny_config(*sgd))
    sharded = run_ranks(4, train_and_report, tiny_config(*sgd, "plan.shard=4",
                                                         "parallel.zero_stage=3"), timeout_s=120)
    assert serial["summary"]["val_mae"] > 0
    for rank_result in sharded:
        assert abs(rank_result["summary"]["val_mae"] - serial["summary"]["val_mae"]) <= \
            1e-5 * serial["summary"]["val_mae"]


class _SkipsAHead(torch.nn.Module):
    """The way people write multi-task models: a head that this training never calls."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.unused_head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


def _two_steps_with_an_unused_parameter(find_unused: bool):
    from exatrain.mesh import init
    from exatrain.parallel import parallelize
    from exatrain.parallel.options import ParallelOptions
    from exatrain.plan import Plan

    mesh = init(Plan(data=2))
    try:
        torch.manual_seed(0)
        model = parallelize(_SkipsAHead(), mesh,
                            ParallelOptions(find_unused_parameters=find_unused))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4)[4 * mesh.rank:4 * mesh.rank + 4]
        try:
            for _ in range(2):
                optim.zero_grad(set_to_none=True)   # as the Trainer does
                model(x).square().mean().backward()
                optim.step()
        except Exception as err:  # noqa: BLE001 - the test inspects it
            return type(err).__name__, str(err)
        return "ok", unwrap(model).body.weight.detach().clone()
    finally:
        mesh.close()


def test_an_unused_parameter_is_named_with_its_fixes_and_the_option_trains_it_as_serial():
    refused = run_ranks(2, _two_steps_with_an_unused_parameter, False)
    for kind, message in refused:
        assert kind == "UnusedParameterError", message
        assert "unused_head.weight" in message and "unused_head.bias" in message
        assert "find_unused_parameters" in message and "body." not in message, message
    trained = run_ranks(2, _two_steps_with_an_unused_parameter, True)
    torch.manual_seed(0)
    serial = _SkipsAHead()
    optim = torch.optim.SGD(serial.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(2):
        optim.zero_grad()
        serial(x).square().mean().backward()
        optim.step()
    for kind, weight in trained:
        assert kind == "ok"
        assert rel_err(weight, serial.body.weight.detach()) <= 1e-6
