"""The input path (data.loader, data.stage): the same samples in the same order whatever the
workers and prefetch depth, the input wait measured, decode on the device equal to the CPU
transform, staging verified and reused, and the node-local shuffle."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import exatrain as et
from exatrain.data.cosmoflow import CosmoFlowDataset, CountsDecoder
from exatrain.data.loader import EpochSampler, LoaderTimeout, Prefetcher, run_loader
from exatrain.data.stage import (MANIFEST, SHARD_HINT, StagingError, check_stage_dir, copy_files,
                                 data_files, stage_dir)
from exatrain.workloads.cosmoflow import Standardize
from harness import run_ranks


class IndexSet(Dataset):
    """Sample i is (tensor([i]), tensor([-i]))."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i]), torch.tensor([-float(i)])


def _epoch_indices(epoch: int, first_step: int, steps: int = 5, per_step: int = 4) -> list[int]:
    perm = np.random.default_rng([7, epoch]).permutation(40)
    return perm[first_step * per_step:steps * per_step].tolist()


@pytest.mark.parametrize("workers,depth", [(0, 0), (0, 2), (2, 1)])
def test_loader_order_is_the_samplers_across_epochs(workers, depth):
    """One loader for three epochs, resumed mid-epoch: exactly the per-epoch lists, in micro-batches
    of 2, whatever the number of workers and the prefetch depth."""
    start = 3  # step 3 of epoch 0 (5 steps an epoch)
    sampler = EpochSampler(_epoch_indices, steps_per_epoch=5, start_step=start)
    source = run_loader(IndexSet(40), sampler, batch_size=2, workers=workers,
                        device=torch.device("cpu"), seed=0)
    batches = Prefetcher(source, torch.device("cpu"), depth=depth)
    try:
        got = [next(batches)[0].flatten().tolist() for _ in range(2 * (2 + 5 + 5))]
    finally:
        batches.close()
    expected = _epoch_indices(0, start) + _epoch_indices(1, 0) + _epoch_indices(2, 0)
    assert [i for b in got for i in b] == expected
    assert all(len(b) == 2 for b in got)


@pytest.mark.parametrize("training_threads", [2, 1])
def test_prefetch_thread_runs_torch_on_one_core_and_leaves_the_training_threads_alone(
        training_threads):
    """A side thread that ran a parallel op keeps its OpenMP team while it lives, and slowed every
    op of the training thread 2.4x on 2 cores: the prefetch thread runs torch on one core, and
    the training thread keeps its own count. On a CPU a training thread with several cores
    decodes itself (with all of them); one with a single core leaves the decode to the prefetch
    thread, where it overlaps the step."""
    threads = {"source": [], "decode": []}

    def source():
        for i in range(4):
            threads["source"].append(torch.get_num_threads())
            yield torch.full((2, 3), float(i)) * 1, torch.zeros(2)

    def decode(x):
        threads["decode"].append((threading.current_thread().name, torch.get_num_threads()))
        return x * 2

    before = torch.get_num_threads()
    torch.set_num_threads(training_threads)
    try:
        batches = Prefetcher(source(), torch.device("cpu"), decode=decode, depth=2)
        try:
            x, _ = next(batches)
        finally:
            batches.close()
        assert torch.get_num_threads() == training_threads
        assert set(threads["source"]) == {1}
        decoder = ("MainThread", 2) if training_threads == 2 else ("exatrain-prefetch", 1)
        assert threads["decode"][0] == decoder
        assert x.tolist() == [[0.0] * 3] * 2
    finally:
        torch.set_num_threads(before)


class MixedFields(Dataset):
    """Sample i: (float32 [3, 2], int64 scalar, uint8 [5]) - fields of three dtypes and sizes."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return (torch.full((3, 2), i + 0.5), torch.tensor(-i),
                torch.arange(5, dtype=torch.uint8) + i)


def test_workers_hand_over_each_batch_in_one_buffer_with_default_collates_values():
    """In a worker, `collate` stacks a batch's fields into views of one shared buffer (one hand-over
    instead of one per field); the batches equal PyTorch's default_collate's, dtype for dtype,
    and samples of another form (dicts, numbers) are collated by PyTorch's."""
    from torch.utils.data import DataLoader, default_collate

    from exatrain.data.batches import collate, packed
    data = MixedFields()
    loader = DataLoader(data, batch_size=4, num_workers=1, collate_fn=collate)
    for index, batch in enumerate(loader):
        expected = default_collate([data[i] for i in range(4 * index, 4 * index + 4)])
        assert type(batch) is list and len(batch) == 3
        for got, want in zip(batch, expected):
            assert got.dtype == want.dtype and torch.equal(got, want)
    samples = [data[i] for i in range(3)]
    fields = packed(samples)
    assert len({f.untyped_storage().data_ptr() for f in fields}) == 1
    assert all(f.data_ptr() % 64 == 0 for f in fields)   # each field on its own cache line
    assert packed([{"x": torch.ones(2)}]) is None and packed([(1.0, 2.0)]) is None
    assert packed([(torch.ones(2),), (torch.ones(3),)]) is None  # ragged: PyTorch's error
    assert packed([(torch.ones(2),), (torch.ones(2), torch.ones(2))]) is None


@pytest.mark.parametrize("workers,decode", [(0, None), (1, None), (1, lambda x: x * 2)])
def test_a_cpu_loader_with_workers_and_nothing_to_decode_has_no_prefetch_thread(workers, decode):
    """On a CPU, worker processes are the prefetch: with nothing to decode no thread moves batches
    from their queue to another. Without workers the thread reads ahead; with a decode on the
    training thread it takes the next batch over meanwhile."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sampler = EpochSampler(lambda e, s: list(range(s * 2, 12)), steps_per_epoch=6,
                               start_step=0)
        source = run_loader(IndexSet(12), sampler, 2, workers, torch.device("cpu"), 0)
        batches = Prefetcher(source, torch.device("cpu"), decode=decode, depth=2,
                             workers=workers)
        try:
            got = [next(batches)[0].flatten().tolist() for _ in range(6)]
        finally:
            batches.close()
        assert (batches._thread is None) == (workers > 0 and decode is None)
        scale = 1 if decode is None else 2
        assert got == [[scale * i, scale * (i + 1)] for i in range(0, 12, 2)]
    finally:
        torch.set_num_threads(before)


def test_prefetcher_raises_the_loaders_error_on_the_training_thread():
    class Broken(IndexSet):
        def __getitem__(self, i):
            if i == 5:
                raise ValueError("sample 5 is corrupt")
            return super().__getitem__(i)

    sampler = EpochSampler(lambda e, s: list(range(s * 2, 10)), steps_per_epoch=5, start_step=0)
    batches = Prefetcher(run_loader(Broken(10), sampler, 2, 0, torch.device("cpu"), 0),
                         torch.device("cpu"), depth=2)
    with pytest.raises(ValueError, match="sample 5 is corrupt"):
        for _ in range(5):
            next(batches)
    batches.close()


class Stuck(IndexSet):
    """Sample 4 blocks its worker (a hung file system) for longer than the loader waits."""

    def __getitem__(self, i):
        if i == 4:
            time.sleep(3)
        return super().__getitem__(i)


def test_a_stuck_loader_worker_is_an_error_that_names_the_fix_not_a_hang():
    sampler = EpochSampler(lambda e, s: list(range(s * 2, 10)), steps_per_epoch=5, start_step=0)
    source = run_loader(Stuck(10), sampler, 2, workers=1, device=torch.device("cpu"), seed=0,
                        timeout_s=0.5)
    batches = Prefetcher(source, torch.device("cpu"), depth=1)
    start = time.monotonic()
    try:
        with pytest.raises(LoaderTimeout, match=r"1 worker process\(es\) delivered no batch in "
                                                r"0.5 s \(run.timeout_s\).*train.num_workers=0"):
            for _ in range(5):
                next(batches)
        waited = time.monotonic() - start
    finally:
        batches.close()
    assert waited < 2.5, f"the error came after {waited:.1f} s, when the worker woke, not at the bound"


def test_counts_decoder_equals_the_cpu_transform(cosmo_data):
    decoded = CosmoFlowDataset(cosmo_data / "train.h5")
    decoded.transform = Standardize(2.5, 0.7)
    raw = CosmoFlowDataset(cosmo_data / "train.h5")
    raw.raw = True
    xs, rs = zip(*[(decoded[i][0], raw[i][0]) for i in range(3)])
    assert rs[0].dtype == torch.int16 and rs[0].shape == (16, 16, 16, 4)  # as stored
    batch = CountsDecoder(mean=2.5, std=0.7)(torch.stack(rs))
    assert batch.shape == (3, 4, 16, 16, 16) and batch.dtype == torch.float32
    assert batch.is_contiguous(memory_format=torch.channels_last_3d)  # no copy for the model
    torch.testing.assert_close(batch, torch.stack(xs), rtol=1e-6, atol=1e-6)
    assert CountsDecoder()(batch) is batch  # decoded inputs pass through


def test_decode_on_device_trains_like_the_cpu_transform(tiny_config, one_thread):
    from exatrain.train.run import run_job
    runs = {}
    for on_device in (True, False):
        summary = run_job(tiny_config("train.steps=4", f"data.decode_on_device={str(on_device).lower()}",
                                      "train.num_workers=0"))
        runs[on_device] = [json.loads(line)["loss"] for line in
                           open(os.path.join(summary["run_dir"], "metrics.jsonl")) if '"loss"' in line]
        # int16 counts travel: half the bytes of float32 (16³ × 4 channels + 4 float targets)
        per_sample = (16 ** 3 * 4 * (2 if on_device else 4)) + 16
        assert summary["input_bytes_per_rank"] == 4 * 8 * per_sample
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-5)


def _slot_of(batch):
    """The loader worker's collate, noting which BufferRing slot the batch's counts occupy."""
    from exatrain.data.batches import collate
    return collate(batch), (batch.lease[1] if batch.lease else None)


def test_worker_buffers_are_reused_only_once_the_training_process_let_go(cosmo_data):
    """A worker reads raw counts into a ring of shared-memory buffers: batches dropped after use
    free their slot (a few slots serve the whole pass), batches kept keep theirs (the ring runs
    out and fresh buffers follow), and no batch ever changes under its holder."""
    from torch.utils.data import DataLoader
    data = CosmoFlowDataset(cosmo_data / "train.h5")
    data.raw = True
    expected = [data[i][0] for i in range(40)]
    batches = [list(range(i, i + 2)) for i in range(0, 40, 2)]

    def run(keep: bool):
        kept, slots = [], []
        loader = DataLoader(data, batch_sampler=batches, num_workers=1, collate_fn=_slot_of)
        for j, ((x, y), slot) in enumerate(loader):
            slots.append(slot)
            assert torch.equal(x, torch.stack(expected[2 * j:2 * j + 2]))
            if keep:
                kept.append(x)
            del x, y
        for j, x in enumerate(kept):  # still what was read, after every later batch
            assert torch.equal(x, torch.stack(expected[2 * j:2 * j + 2]))
        return slots

    dropped = run(keep=False)
    assert None not in dropped and len(set(dropped)) <= 4, dropped  # the loader's prefetch: 2
    kept = run(keep=True)
    assert kept[:8] == list(range(8)) and kept[8:] == [None] * 12  # 8 slots, then fresh buffers


# ---------------------------------------------------------------- the input wait, measured
class SlowSet(Dataset):
    """Reading a sample takes `delay_s` (a sleep, like a slow file system)."""

    def __init__(self, n: int, delay_s: float):
        self.n, self.delay_s = n, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return torch.full((4,), float(i % 7)), torch.tensor([float(i % 3)])


class SlowModel(nn.Module):
    """A step that computes for `compute_s` (a sleep in forward, like a kernel the GPU runs)."""

    def __init__(self, compute_s: float):
        super().__init__()
        self.compute_s = compute_s
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(self.compute_s)
        return self.linear(x)


def _wait(tmp_path, name: str, workers: int, prefetch: int) -> dict:
    # a batch of 2 takes 2 × 15 ms to read; the step computes 60 ms: 1/3 of a step is input
    # wait when loading on the training thread, none when the loader runs ahead
    return et.fit(SlowModel(0.060), SlowSet(64, 0.015), SlowSet(4, 0.0), loss=nn.functional.mse_loss,
                  train={"steps": 12, "batch_size": 2, "log_every": 6, "eval_every": 0,
                         "num_workers": workers, "prefetch": prefetch},
                  run={"out_dir": str(tmp_path / name)}, observe={"tensorboard": False})


def test_data_wait_fraction_measures_a_slow_dataset_and_prefetch_hides_it(tmp_path, one_thread):
    inline = _wait(tmp_path, "inline", workers=0, prefetch=0)
    assert 0.2 <= inline["data_wait_fraction"] <= 0.5, inline["data_wait_fraction"]  # known: 1/3
    assert inline["data_wait_s_median"] >= 0.025
    assert "data_wait_advice" in inline and "train.prefetch" in inline["data_wait_advice"]
    ahead = _wait(tmp_path, "ahead", workers=0, prefetch=2)
    assert ahead["data_wait_fraction"] < 0.05, ahead["data_wait_fraction"]
    assert "data_wait_advice" not in ahead
    workers = _wait(tmp_path, "workers", workers=2, prefetch=2)
    assert workers["data_wait_fraction"] < 0.05, workers["data_wait_fraction"]
    records = [json.loads(l) for l in open(os.path.join(inline["run_dir"], "metrics.jsonl"))]
    assert all("data_wait_s" in r and "data_wait_fraction" in r for r in records if "loss" in r)


# ---------------------------------------------------------------- staging
def _files(root, sizes: dict) -> None:
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(np.random.default_rng(size).bytes(size))


def test_staging_copies_verifies_reuses_and_recopies_a_corrupt_copy(tmp_path):
    source, stage_to = tmp_path / "lustre" / "set", tmp_path / "shm"
    _files(source, {"train/a.h5": 3000, "train/b.h5": 5000, "val/c.h5": 700})
    (source / ".hidden").write_text("not data")
    stage_to.mkdir()
    dest = stage_dir(source, stage_to)
    wanted = [source / "train/a.h5", source / "val/c.h5"]
    first = copy_files(wanted, source, dest)
    assert sorted(first.copied) == ["train/a.h5", "val/c.h5"] and first.copied_bytes == 3700
    assert not (dest / "train/b.h5").exists()  # exactly the files asked for
    for rel in first.copied:
        assert (dest / rel).read_bytes() == (source / rel).read_bytes()
    manifest = json.loads((dest / MANIFEST).read_text())
    assert set(manifest) == {"train/a.h5", "val/c.h5"}
    again = copy_files(wanted, source, dest)  # an identical copy is reused, verified
    assert again.copied == [] and sorted(again.reused) == ["train/a.h5", "val/c.h5"]
    broken = bytearray((dest / "val/c.h5").read_bytes())
    broken[10] ^= 0xFF
    (dest / "val/c.h5").write_bytes(bytes(broken))  # same size, one byte flipped
    healed = copy_files(wanted, source, dest)
    assert healed.copied == ["val/c.h5"] and healed.reused == ["train/a.h5"]
    assert (dest / "val/c.h5").read_bytes() == (source / "val/c.h5").read_bytes()
    assert data_files(source) == [source / "train/a.h5", source / "train/b.h5", source / "val/c.h5"]


def test_stage_dir_missing_read_only_or_too_small_is_refused(tmp_path):
    with pytest.raises(StagingError, match="no such directory.*mkdir"):
        check_stage_dir(tmp_path / "absent", 10, rank=3)
    with pytest.raises(StagingError, match="not writable"):
        check_stage_dir("/sys", 10, rank=0)  # not writable even by root
    with pytest.raises(StagingError, match="free, the copy needs") as info:
        check_stage_dir(tmp_path, 1 << 60, rank=0)
    # the node shuffle shrinks only a copy of per-sample training files: advised only there
    assert "shuffle" not in str(info.value)
    with pytest.raises(StagingError, match="data.shuffle = \"node\" so each node stages only"):
        check_stage_dir(tmp_path, 1 << 60, rank=0, smaller=SHARD_HINT)


def test_staging_error_comes_before_training(tiny_config, tmp_path, one_thread):
    from exatrain.train.run import run_job
    with pytest.raises(StagingError, match="no such directory") as info:
        run_job(tiny_config("train.steps=2", f"data.stage_to={tmp_path}/not-there"))
    assert "rank 0" in str(info.value)
    assert not list((tmp_path / "runs").glob("*/metrics.jsonl"))  # no step was taken


@pytest.fixture
def mlperf_data(cosmo_data, tmp_path):
    """The session's samples as MLPerf per-sample files: train/ (42), validation/ (6), and
    files the run never reads (test/, a README)."""
    import h5py
    root = tmp_path / "mlperf"
    for split, source in (("train", "train.h5"), ("validation", "val.h5"), ("test", "val.h5")):
        (root / split).mkdir(parents=True)
        with h5py.File(cosmo_data / source, "r") as f:
            for i in range(len(f["x"])):
                with h5py.File(root / split / f"sample{i:03d}.h5", "w") as out:
                    out["full"], out["unitPar"] = f["x"][i], f["y"][i]
    (root / "README").write_text("not read by a run")
    return root


def _tree(root) -> dict:
    """{relative path: "copy" or the target of a link} under `root` (hidden names left out)."""
    return {str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else "copy"
            for p in sorted(root.rglob("*")) if not p.name.startswith(".") and not p.is_dir()}


def test_staging_copies_exactly_the_files_the_run_reads(tiny_config, mlperf_data, tmp_path):
    """Global shuffle: every training and validation sample file, nothing else (not test/, not
    the README); the run then reads the copy."""
    from exatrain.mesh import init
    from exatrain.plan import Plan
    from exatrain.train.run import stage_input
    stage_to = tmp_path / "shm"
    stage_to.mkdir()
    config = tiny_config(f"data.path={mlperf_data}", f"data.stage_to={stage_to}")
    mesh = init(Plan())
    try:
        figures = stage_input(config, mesh)
    finally:
        mesh.close()
    needed = {f"{split}/sample{i:03d}.h5" for split, n in (("train", 42), ("validation", 6))
              for i in range(n)}
    assert _tree(Path(config.data.path)) == {rel: "copy" for rel in needed}
    assert figures["stage_copied_bytes"] == sum((mlperf_data / rel).stat().st_size for rel in needed)
    assert figures["stage_files"] == 48 and figures["stage_linked_files"] == 0
    assert figures["stage_copier_rank"] == 0


def _staged_and_node_shuffled(config, node_of_rank):
    """On each rank: pretend to be on node node_of_rank[rank]; train 2 steps of a run that
    stages its data and shuffles per node; return what this rank read and where."""
    import torch.distributed as dist
    from exatrain.data.stage import HOST_ENV
    from exatrain.train.run import setup
    rank = int(os.environ["RANK"])
    os.environ[HOST_ENV] = f"node{node_of_rank[rank]}"
    try:
        mesh, trainer = setup(config)
        epoch = trainer.sampling.rank_indices(0, 0)
        summary = trainer.fit()
        mesh.close()
        return {"epoch": epoch, "steps_per_epoch": trainer.steps_per_epoch,
                "data_path": config.data.path, "n": len(trainer.workload.train_set),
                **{k: v for k, v in summary.items() if k.startswith("stage")}}
    finally:
        os.environ.pop(HOST_ENV, None)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_node_shuffle_reads_each_sample_once_per_epoch_per_node_and_stages_only_its_shard(
        tiny_config, mlperf_data, tmp_path):
    stage_to = tmp_path / "node-local"
    stage_to.mkdir()
    config = tiny_config(f"data.path={mlperf_data}", "train.steps=2", "data.shuffle=node",
                         f"data.stage_to={stage_to}", "train.batch_size=8", "train.num_workers=0")
    ranks = run_ranks(4, _staged_and_node_shuffled, config, [0, 0, 1, 1])
    n = ranks[0]["n"]
    assert n == 42  # every sample listed on every node: its shard copied, the others linked
    shards = np.array_split(np.arange(n), 2)
    validation = {f"validation/sample{i:03d}.h5" for i in range(6)}
    for node, members in ((0, ranks[:2]), (1, ranks[2:])):
        read = [i for r in members for i in r["epoch"]]
        assert len(read) == len(set(read))  # no sample twice in an epoch on a node
        assert set(read) <= set(shards[node].tolist())  # and only the node's shard
        # 2 replicas × 2 samples per step, 21 samples a shard: 5 steps use 20 of them
        assert len(read) == members[0]["steps_per_epoch"] * 4 == 20
        # the node's copy: its shard and the validation files, copied; the rest, links
        staged = Path(members[0]["data_path"])
        assert staged.is_relative_to(stage_to) and members[1]["data_path"] == str(staged)
        shard = {f"train/sample{i:03d}.h5" for i in shards[node]}
        expected = {rel: "copy" for rel in shard | validation}
        expected.update({f"train/sample{i:03d}.h5": str((mlperf_data / "train" /
                         f"sample{i:03d}.h5").resolve()) for i in shards[1 - node]})
        assert _tree(staged) == expected
        # one copier per node, the node's lowest rank: each file's bytes counted once
        assert [r["stage_copier_rank"] for r in members] == [2 * node] * 2
        size = sum((mlperf_data / rel).stat().st_size for rel in shard | validation)
        assert [r["stage_copied_bytes"] for r in members] == [size] * 2
        assert all(r["stage_linked_files"] == 21 and r["stage_s"] > 0 for r in members)


def _batches_across_the_epoch_end(config) -> dict:
    """On a rank: the Trainer's batches from two steps before an epoch's end, and the samples
    its per-epoch permutation slices hold."""
    from exatrain.train.run import setup
    torch.set_num_threads(1)
    mesh, trainer = setup(config)
    try:
        workers = trainer.num_workers
        targets = torch.as_tensor(trainer.workload.train_set.targets())
        per_epoch = trainer.steps_per_epoch  # 42 samples, batches of 8: 5 steps
        start = per_epoch - 2
        batches = trainer.sampling.batches(start, trainer.decode)
        try:
            got = torch.cat([next(batches)[1] for _ in range(2 + per_epoch)])
        finally:
            batches.close()
        order = trainer.sampling.rank_indices(0, start) + trainer.sampling.rank_indices(1, 0)
        return {"workers": workers, "got": got, "expected": targets[order]}
    finally:
        mesh.close()


def test_trainer_batches_are_todays_order_across_an_epoch_and_a_resume(tiny_config):
    """The Trainer's batches (default workers, prefetch, decode on the device) hold exactly the
    samples of its per-epoch permutation slices, from a mid-epoch start across the epoch's end.

    In a fresh process: once (1 of ~6 full-suite runs, 2026-11-25) the loader's forked workers
    here never delivered a batch after the suite's earlier tests had left threads in the pytest
    process (TensorBoard writers, rank pools' queue feeders, gloo); the cause is not found yet."""
    result, = run_ranks(1, _batches_across_the_epoch_end,
                        tiny_config("train.steps=2", "train.num_workers=2"), fresh=True)
    assert result["workers"] == 2  # read in worker processes
    assert torch.equal(result["got"], result["expected"])


class _CollectsGarbage(Dataset):
    """A data set whose worker runs the garbage collector, as any allocation there may."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import gc
        gc.collect()
        return torch.tensor([i])


def test_forked_workers_leave_the_parents_garbage_alone(tmp_path):
    """A process group left in a reference cycle is garbage the parent has not collected yet; a
    forked worker's collector destroyed it and hung for ever in gloo's destructor (seen in the
    suite: an in-process run after earlier runs). The loader's workers start with it frozen."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    class Cycle:
        pass

    garbage = Cycle()
    garbage.me, garbage.group = garbage, dist.new_group([0])
    del garbage
    dist.destroy_process_group()
    batches = run_loader(_CollectsGarbage(), range(8), 2, 1, torch.device("cpu"), 0, timeout_s=20)
    assert next(batches).tolist() == [[0], [1]]   # without the freeze: LoaderTimeout after 20 s
