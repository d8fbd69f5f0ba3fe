"""`comm.dtensor`: the one test of "is this a DTensor" and the local piece of one, on real
DTensors of a 2-rank gloo mesh (sharded and replicated, a DTensor parameter as FSDP2 makes),
against plain tensors and parameters."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from exatrain.comm.dtensor import is_dtensor, local_tensor
from exatrain.mesh import init
from exatrain.plan import Plan
from harness import run_ranks


def _check() -> dict:
    world = init(Plan(data=2))
    try:
        mesh, rank = world.device_mesh["data"], world.rank
        full = torch.arange(12.0).reshape(4, 3)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        replicated = distribute_tensor(full, mesh, [Replicate()])
        param = torch.nn.Parameter(sharded)
        plain = torch.ones(2)
        return {
            "dtensors": [is_dtensor(t) for t in (sharded, replicated, param)],
            "plain": [is_dtensor(t) for t in (plain, torch.nn.Parameter(plain), None, 3.0)],
            "local_is_shard": torch.equal(local_tensor(sharded), full[2 * rank:2 * rank + 2]),
            "local_replicated": torch.equal(local_tensor(replicated), full),
            "local_param_plain": type(local_tensor(param)) is torch.Tensor,
            "plain_unchanged": local_tensor(plain) is plain,
        }
    finally:
        world.close()


def test_is_dtensor_and_local_tensor_on_real_dtensors():
    for result in run_ranks(2, _check):
        assert result == {"dtensors": [True] * 3, "plain": [False] * 4, "local_is_shard": True,
                          "local_replicated": True, "local_param_plain": True,
                          "plain_unchanged": True}
