"""Failures on one rank are reported with the rank and its traceback, and nothing hangs."""

import pytest
import torch
import torch.distributed as dist

from exatrain.launch import spawn
from exatrain.launch.local import RankFailed
from exatrain.mesh import init
from exatrain.plan import Plan
from harness import run_ranks


def fail_on_rank_one_after_a_collective():
    mesh = init(Plan(data=2))
    x = torch.ones(1)
    dist.all_reduce(x)
    if mesh.rank == 1:
        raise ValueError("bad shape on purpose")
    dist.all_reduce(x)  # rank 0 waits here for a peer that is gone
    return float(x)


def world_sum():
    mesh = init(Plan(data=2))
    x = torch.tensor([float(mesh.rank + 1)])
    dist.all_reduce(x)
    mesh.close()
    return float(x)


def test_spawn_reports_the_failing_rank_and_stops_the_others():
    with pytest.raises(RankFailed, match="rank 1 of 2 failed: ValueError: bad shape on purpose") as info:
        spawn(fail_on_rank_one_after_a_collective, 2, grace_s=2)
    assert info.value.rank == 1 and "traceback on rank 1" in str(info.value)
    assert spawn(world_sum, 2) == [3.0, 3.0]


def test_pool_harness_recovers_after_a_failure():
    with pytest.raises(RankFailed, match="bad shape on purpose"):
        run_ranks(2, fail_on_rank_one_after_a_collective)
    assert run_ranks(2, world_sum) == [3.0, 3.0]
