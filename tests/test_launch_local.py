"""Failures on one rank are reported with the rank and its traceback, and nothing hangs."""

import gc
import os
import subprocess
import sys
from pathlib import Path

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


_PROBE = '''
import os, sys
import torch

def probe():
    return os.environ.get("EXATRAIN_TEST_PROBE"), os.getcwd(), torch.get_num_threads()
'''


def test_ranks_see_the_callers_environment_directory_and_import_path_at_launch(tmp_path,
                                                                                monkeypatch):
    """Ranks fork from a server started at the first launch; what the caller changed since (an
    environment variable, the working directory, a module only its new import path finds)
    reaches the ranks of the next launch."""
    assert spawn(world_sum, 2) == [3.0, 3.0]   # the forkserver runs from here on
    (tmp_path / "user_probe_module.py").write_text(_PROBE)
    monkeypatch.setenv("EXATRAIN_TEST_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_probe_module

    results = spawn(user_probe_module.probe, 2)
    assert results == [("set after the server started", str(tmp_path), 1)] * 2


def test_a_compile_setting_changed_after_the_first_launch_is_named(tmp_path):
    """torch reads its compile and logging variables once, as the forkserver imports it; one
    set after the first launch cannot reach the ranks, and rank 0 says so, with the fix (a
    process of its own: the forked ranks write on the stderr of the server, which started there)."""
    driver = ("import os\nfrom exatrain.launch import spawn\n"
              "spawn(os.getcwd, 2)\n"
              "os.environ['TORCHINDUCTOR_FX_GRAPH_CACHE'] = '0'\n"
              # read at every use, and written by torch itself as it first compiles: not named
              "os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.getcwd()\n"
              "spawn(os.getcwd, 2)\n")
    done = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "TORCHINDUCTOR_FX_GRAPH_CACHE" in line]
    assert len(notes) == 1, done.stderr   # rank 0's, at the second launch only
    assert "EXATRAIN_START_METHOD=spawn" in notes[0] and "before the first launch" in notes[0]
    assert "TORCHINDUCTOR_CACHE_DIR" not in done.stderr


def _gloo_threads() -> int:
    """gloo's connection threads in this process: one per process group (gloo makes a device,
    and a thread that wakes every 10 ms, for each)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            count += Path(f"/proc/self/task/{task}/comm").read_text().strip() == "gloo_tcp_loop"
        except OSError:  # a thread that ended since the listing
            pass
    return count


def _fit_three_times(out_dir: str, plan: dict) -> list[tuple[int, int]]:
    import exatrain as et
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    counts = []
    for i in range(3):
        seen = []

        def loss(output, target):  # counted while the mesh is alive
            seen.append(_gloo_threads())
            return torch.nn.functional.mse_loss(output, target)
        et.fit(lambda: nn.Linear(4, 1), data, data, loss=loss, plan=et.Plan(**plan),
               train={"steps": 1, "batch_size": 8}, run={"out_dir": out_dir, "name": f"fit{i}"})
        gc.collect()
        counts.append((max(seen, default=-1), _gloo_threads()))
    return counts


def test_fits_in_one_launch_under_shard_each_train(tmp_path):
    """Three fits in one launch under Plan(data=2, shard=2), on groups smaller than the job
    (DTensor's sharding cache keys a mesh by its layout, not its groups: a later fit's DTensors
    meet the earlier mesh, so its groups must still resolve)."""
    for counts in run_ranks(4, _fit_three_times, str(tmp_path), {"data": 2, "shard": 2}):
        assert len(counts) == 3, counts


@pytest.mark.xfail(strict=True, reason="a launched process keeps every mesh's groups: each fit "
                   "adds 7 gloo groups per rank for Plan(data=2) on 2 ranks, each with a thread "
                   "that wakes every 10 ms. Ending them in Mesh.close() broke a later fit under "
                   "shard (test above); reusing one DeviceMesh per Plan in the process would not")
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_fits_in_one_launch_do_not_pile_up_groups(tmp_path):
    for counts in run_ranks(2, _fit_three_times, str(tmp_path), {"data": 2}):
        after = [a for _, a in counts]
        assert after == [after[0]] * 3, counts       # the job's own groups only, fit after fit


def _imported_and_frozen() -> tuple[bool, int, bool]:
    return "torch._dynamo" in sys.modules, gc.get_freeze_count(), gc.isenabled()


@pytest.mark.skipif(os.environ.get("EXATRAIN_START_METHOD") == "spawn",
                    reason="spawned ranks are fresh interpreters, not forked from the server")
def test_ranks_fork_with_torch_and_dynamo_imported_frozen_and_the_collector_on():
    """The forkserver imports what every rank needs (launch.preload), collector paused, then
    frozen: a forked rank neither imports torch._dynamo at its first optimizer nor has its
    collections traverse, and copy, the server's objects."""
    for dynamo, frozen, collecting in spawn(_imported_and_frozen, 2):
        assert dynamo and frozen > 100_000 and collecting, (dynamo, frozen, collecting)


@pytest.mark.parametrize("collecting", [True, False])
def test_importing_exatrain_leaves_the_collector_as_it_was(collecting):
    code = (f"import gc\n{'' if collecting else 'gc.disable()'}\nimport exatrain\n"
            "from exatrain.launch.preload import import_rank_modules\nimport_rank_modules()\n"
            "print(gc.isenabled())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == str(collecting), done.stderr[-2000:]
