"""Shared fixtures: small real data sets (CosmoFlow, the stdlib text corpus, QM9), a tiny-model
config builder, and a one-thread switch for in-process training tests."""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import pytest
import torch

from exatrain.data.cosmoflow_synth import write_cosmoflow
from exatrain.data.text import write_text_corpus
from exatrain.launch.host_memory import keep_freed_host_memory
from exatrain.train.config import load_config
from harness import true_fp32_on_cuda

# Every interpreter the suite starts (`exatrain run` subprocesses, srun/torchrun/sbatch ranks, a
# forkserver, the rank pools' first import of a test module) would compile exatrain's and the
# tests' sources anew where PYTHONDONTWRITEBYTECODE is set (CI's environment: no __pycache__ is
# ever written): ~0.3 s of CPU each (measured: a 2-step fit, 3.7 s -> 3.4 s). Compiled once here
# (~0.4 s; compileall writes despite the variable, and only what changed), the children read it.
_REPO = Path(__file__).resolve().parents[1]
for _tree in (_REPO / "src" / "exatrain", _REPO / "tests"):
    compileall.compile_dir(_tree, quiet=2, workers=1)

# the test process allocates like a rank of `exatrain run` (run.host_memory = "keep")
keep_freed_host_memory()
true_fp32_on_cuda()  # serial references on a shared GPU in true float32, as the ranks


def pytest_xdist_auto_num_workers(config) -> int:
    """How many workers `-n auto` (pyproject's addopts) starts: one per two cores, two at least.
    One worker left the 2 cores idle 22 % of the time (2026-11-29: ranks waiting on each other,
    on a launcher's start-up, on a fault's timeout); a second runs its files in those gaps. More
    than one per two cores would oversubscribe them: a case's ranks take a core each."""
    return max(2, (os.cpu_count() or 1) // 2)


# The longest files (measured on 2 cores, 2026-11-29: 60 to 210 s each), run first: the workers
# share them out while the rest of the suite is still queued, instead of one finishing the last
# of them alone (pyproject's --no-loadscope-reorder keeps this order). A stale list only changes
# the order.
LONGEST_FIRST = ("test_fault_tolerance_launched.py", "test_clean_exit.py", "test_replica_sync.py",
                 "test_user_api.py", "test_fault_tolerance.py", "test_slurm.py",
                 "test_user_models_every_axis.py", "test_planner.py", "test_hosts.py",
                 "test_bench_faults_recovery.py", "test_user_errors.py",
                 "test_fault_tolerance_hosts.py", "test_elastic_hosts.py", "test_trackers.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as found


TINY = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
        "data.generate=false", "train.batch_size=8", "train.log_every=1", "optim.lr=0.003"]


@pytest.fixture(scope="session", autouse=True)
def own_systems_folder(tmp_path_factory):
    """The planner's user systems folder for this session: the tests neither read a system the
    user calibrated (a cpu-local of their own would change every prediction) nor write into
    their ~/.config."""
    before = os.environ.get("EXATRAIN_SYSTEMS_DIR")
    os.environ["EXATRAIN_SYSTEMS_DIR"] = str(tmp_path_factory.mktemp("systems"))
    yield
    if before is None:
        os.environ.pop("EXATRAIN_SYSTEMS_DIR", None)
    else:
        os.environ["EXATRAIN_SYSTEMS_DIR"] = before


@pytest.fixture(scope="session")
def qm9_dir(tmp_path_factory):
    """The real QM9 molecules converted from the qm9pack CSVs, once per test session (~10 s)."""
    from exatrain.data.qm9 import convert_qm9

    path = tmp_path_factory.mktemp("qm9")
    convert_qm9(path)
    return path


@pytest.fixture(scope="session")
def cosmo_data(tmp_path_factory):
    """48 samples of 16³ CosmoFlow fields (42 train, 6 val), written once per test session."""
    path = tmp_path_factory.mktemp("cosmoflow16")
    write_cosmoflow(path, samples=48, size=16, seed=3)
    return path


@pytest.fixture
def tiny_config(cosmo_data, tmp_path):
    """A config for a tiny CosmoFlow on the session's data; pass extra `section.key=value`s."""
    def make(*overrides: str):
        return load_config(None, [*TINY, f"data.path={cosmo_data}", f"run.out_dir={tmp_path}/runs",
                                  *overrides])
    return make


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """300 kB of the Python standard library's source as byte tokens (10% validation)."""
    path = tmp_path_factory.mktemp("text")
    write_text_corpus(path, max_bytes=300_000, val_fraction=0.1)
    return path


@pytest.fixture
def one_thread():
    """Run torch on one thread, restored afterwards: tiny models are faster on one, and on a
    shared 2-core machine intra-op threads contending with other processes cost ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
