"""`exatrain bench data`: can the input path feed the model? The loader alone against the model's
appetite, for every built-in workload, on this machine.

Per workload (CosmoFlow at 32³ and at MLPerf's 128³ with MLPerf's model, DeepCAM, the ViT
forecaster, GPT, QM9; the GCN trains on one whole graph held in memory, so it has no loader):

  loader_samples_per_s_w{0,1,2}   the loader alone (read, collate, copy ahead; decode on the
                                  device where the workload does) from a warm page cache, with 0
                                  (the prefetch thread reads), 1 and 2 worker processes
  read_bytes_per_s_w{N}           the bytes it delivered per second (as stored for raw inputs)
  loader_samples_per_s_cold       1 worker, files evicted from the page cache first
                                  (fsync + posix_fadvise(DONTNEED)): what a first epoch reads
  stage_s, stage_bytes_per_s      copying the data set to node-local storage (/dev/shm)
  loader_samples_per_s_staged     1 worker, cold, from the staged copy
  model_samples_per_s             the model's appetite: steps (forward, backward, optimizer) on
                                  one batch already in memory, one rank's share of the cores
  loader_over_model               loader_samples_per_s at the default workers / appetite (>= 2:
                                  the loader keeps ahead even when the run disturbs it)
  run_data_wait_fraction          a real `exatrain run` of the workload on 2 ranks: median share
                                  of a step spent waiting for input

For CosmoFlow 128³ also: the loader with the transform on the CPU (float32, log1p: the path
before decode on the device), a `space=(1,1,2)` rank's hyperslab reads, the per-core loader rate
and `cores_per_gpu`: the loader cores one GPU needs at `--gpu-rate` samples/s (NVIDIA's MLPerf HPC
v3.0 CosmoFlow: about 200 samples/s per H100).

All variants run in one launch on the same files; rates are medians of `--repeats` passes over the
same samples, after a warm-up pass.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

GPU_RATE = 200.0  # CosmoFlow 128³ samples/s per H100 in NVIDIA's MLPerf HPC v3.0 submission

# (workload, config overrides) for each case: the examples' models, smaller data sets
CASES = {
    "cosmoflow32": ["run.workload=cosmoflow", "data.samples=320"],
    "cosmoflow128": ["run.workload=cosmoflow", "model.size=128", "model.base_channels=32",
                     "model.batchnorm=false", "data.size=128", "data.samples=40",
                     "train.batch_size=4"],
    "deepcam": ["run.workload=deepcam", "model.width=16", "data.samples=96", "model.dropout=0.1"],
    "vit": ["run.workload=vit", "data.trajectories=6"],
    "gpt": ["run.workload=gpt", "data.max_bytes=2000000", "train.batch_size=16"],
    "qm9": ["run.workload=qm9", "data.train_molecules=20000", "data.val_molecules=2000",
            "train.batch_size=64"],
}


def add_arguments(parser) -> None:
    parser.add_argument("--workloads", default=",".join(CASES),
                        help=f"comma-separated cases (default: all of {', '.join(CASES)})")
    parser.add_argument("--data-dir", default="data/bench-data",
                        help="where the cases' data sets are written once (default data/bench-data)")
    parser.add_argument("--stage-to", default="/dev/shm" if Path("/dev/shm").is_dir() else "",
                        help="node-local directory for the staging case (default /dev/shm)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per variant")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="seconds per timed pass (at most one pass over the samples)")
    parser.add_argument("--real-steps", type=int, default=40,
                        help="steps of the real 2-rank run per workload (0: skip it)")
    parser.add_argument("--gpu-rate", type=float, default=GPU_RATE,
                        help="CosmoFlow 128³ samples/s one GPU takes, for cores_per_gpu")


def _config(case: str, data_dir: str, extra: list[str] = ()):
    from ..train.config import load_config
    return load_config(None, [*CASES[case], f"data.path={data_dir}/{case}", "run.nproc=2",
                              *extra])


def _mesh():
    from ..mesh import init
    from ..plan import Plan
    return init(Plan())


def _files(path: Path) -> list[Path]:
    from ..data.stage import data_files
    return data_files(path)


def evict(path: Path) -> None:
    """Drop a data set's files from the page cache (flushed first: only clean pages go)."""
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def loader_rate(workload, dataset, micro: int, workers: int, seconds: float, repeats: int,
                cold_path: Path | None = None) -> tuple[float, float]:
    """(samples/s, bytes/s) of the run's input path alone: a loader with `workers`, prefetch 2,
    decode by the workload, timed from its first batch (worker start-up is paid once a run) for
    at least `seconds`; median over `repeats` passes (after a warm-up pass when warm)."""
    from ..data.loader import EpochSampler, Prefetcher, run_loader
    n = len(dataset)
    order = [(i * 7919) % n for i in range(n)]  # spread over the files, the same every pass
    rates, byte_rates = [], []
    for attempt in range(repeats + (0 if cold_path else 1)):
        if cold_path is not None:
            evict(cold_path)
        sampler = EpochSampler(lambda e, s: order, steps_per_epoch=1, start_step=0)
        source = run_loader(dataset, sampler, micro, workers, torch.device("cpu"), seed=0)
        feed = Prefetcher(source, torch.device("cpu"), decode=workload.decode, depth=2)
        try:
            next(feed)
            feed.take()
            start, batches = time.perf_counter(), 0
            while time.perf_counter() - start < seconds and batches < max(1, n // micro - 1):
                next(feed)
                batches += 1
            elapsed = time.perf_counter() - start
        finally:
            feed.close()
        _, size = feed.take()
        if cold_path is None and attempt == 0:
            continue
        rates.append(batches * micro / elapsed)
        byte_rates.append(size / elapsed)
    return statistics.median(rates), statistics.median(byte_rates)


def model_rate(workload, config, micro: int, steps: int = 6) -> float:
    """Samples/s of forward + backward + optimizer on one in-memory batch (one rank's share)."""
    from ..train.trainer import build_optimizer
    batch = [workload.train_set[i] for i in range(micro)]
    x = workload.decode_inputs(torch.stack([b[0] for b in batch]))
    y = torch.stack([torch.as_tensor(b[1]) for b in batch])
    model = workload.model
    model.train()
    optimizer = build_optimizer(model.parameters(), config.optim, 1e-4)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        loss = workload.loss_fn(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return micro / statistics.median(times)


def _real_run(config) -> dict:
    from ..train.run import run_job
    summary = run_job(config)
    return {k: summary.get(k) for k in ("data_wait_fraction", "data_wait_s_median", "step_s_median",
                                        "input_bytes_per_s", "num_workers")}


def real_run_wait(case: str, data_dir: str, steps: int, out_dir: str) -> dict:
    """The data_wait_fraction of a real 2-rank `exatrain run` of the case (default workers)."""
    from ..launch import spawn
    config = _config(case, data_dir, [f"train.steps={steps}", f"train.log_every={steps}",
                                      "train.eval_every=0", f"run.out_dir={out_dir}",
                                      "observe.tensorboard=false", "data.generate=false"])
    return spawn(_real_run, 2, args=(config,))[0]


def run_case(case: str, args, mesh) -> dict:
    from ..data.loader import cores_per_rank, default_workers
    from ..data.stage import copy_files, stage_dir
    from ..train.config import micro_batch_size
    from ..workloads import get_workload

    config = _config(case, args.data_dir)
    module = get_workload(config.run.workload)
    module.prepare(config)
    torch.manual_seed(0)
    workload = module.build(config, mesh)
    micro = micro_batch_size(config, 2)  # a rank's batch in the 2-rank default job
    path = Path(config.data.path)
    out: dict = {"micro_batch": micro}
    warm = {}
    for workers in (0, 1, 2):
        warm[workers], out[f"read_bytes_per_s_w{workers}"] = loader_rate(
            workload, workload.train_set, micro, workers, args.seconds, args.repeats)
        out[f"loader_samples_per_s_w{workers}"] = warm[workers]
    out["loader_samples_per_s_cold"], out["read_bytes_per_s_cold"] = loader_rate(
        workload, workload.train_set, micro, 1, args.seconds, args.repeats, cold_path=path)
    if args.stage_to:
        with tempfile.TemporaryDirectory(dir=args.stage_to, prefix="exatrain-bench-") as shm:
            evict(path)
            start = time.perf_counter()
            staged = copy_files(_files(path), path, stage_dir(path, shm))
            out["stage_s"] = time.perf_counter() - start
            out["stage_bytes_per_s"] = staged.copied_bytes / out["stage_s"]
            staged_config = _config(case, args.data_dir, [f"data.path={staged.path}",
                                                          "data.generate=false"])
            torch.manual_seed(0)
            staged_workload = module.build(staged_config, mesh)
            out["loader_samples_per_s_staged"], _ = loader_rate(
                staged_workload, staged_workload.train_set, micro, 1, args.seconds, args.repeats)
    threads = torch.get_num_threads()
    torch.set_num_threads(cores_per_rank(2))  # one rank's share, as in the 2-rank job
    try:
        out["model_samples_per_s"] = model_rate(workload, config, micro)
    finally:
        torch.set_num_threads(threads)
    default = default_workers(2)
    out["default_workers"] = default
    out["loader_over_model"] = warm[min(default, 2)] / out["model_samples_per_s"]
    if case == "cosmoflow128":
        out.update(_cosmoflow128_extras(workload, micro, args, warm))
        out["loader_bytes_per_s_per_core"] = out["read_bytes_per_s_w1"]
    if args.real_steps:
        run = real_run_wait(case, args.data_dir, args.real_steps,
                            str(Path(args.data_dir) / "runs"))
        out.update({f"run_{k}": v for k, v in run.items()})
    return out


def _cosmoflow128_extras(workload, micro: int, args, warm: dict) -> dict:
    """The CPU-decode path, a spatial rank's hyperslab reads, the cores one GPU needs."""
    from ..parallel.spatial import SpatialBlocks
    data = workload.train_set
    out = {}
    data.raw = False  # the path before decode on the device: float32 + log1p in the loader
    decode, workload.decode = workload.decode, None
    try:
        out["cpu_decode_loader_samples_per_s_w1"], out["cpu_decode_read_bytes_per_s_w1"] = \
            loader_rate(workload, data, micro, 1, args.seconds, args.repeats)
    finally:
        data.raw, workload.decode = True, decode
    edge = data.sample_shape[0]
    half = (slice(None), slice(None), slice(0, edge // 2))  # rank 0 of space=(1,1,2)
    out["space2_loader_samples_per_s_w1"], out["space2_read_bytes_per_s_w1"] = loader_rate(
        workload, SpatialBlocks(data, half), micro, 1, args.seconds, args.repeats)
    per_core = warm[1]  # one worker process: one core reads, collates and hands over
    out["loader_samples_per_s_per_core"] = per_core
    out["gpu_rate_samples_per_s"] = args.gpu_rate
    out["cores_per_gpu"] = args.gpu_rate / per_core
    return out


def run(args) -> dict:
    cases = [c.strip() for c in args.workloads.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    mesh = _mesh()
    result: dict = {}
    try:
        for case in cases:
            start = time.perf_counter()
            figures = run_case(case, args, mesh)
            figures["bench_s"] = time.perf_counter() - start
            result.update({f"{case}_{k}": v for k, v in figures.items()})
    finally:
        mesh.close()
    result["loader_over_model_min"] = min(result[f"{c}_loader_over_model"] for c in cases)
    return result
