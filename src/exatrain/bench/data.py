"""`exatrain bench data`: can the input path feed the model? The loader alone against the model's
appetite, for every built-in workload, on this machine.

Per workload (CosmoFlow at 32³ and at MLPerf's 128³ with MLPerf's model, DeepCAM, the ViT
forecaster, GPT, QM9; the GCN trains on one whole graph held in memory, so it has no loader):

  loader_samples_per_s_w{0,1,2}   the loader alone (read, collate, copy ahead; decode on the
                                  device where the workload does) from a warm page cache, with 0
                                  (the prefetch thread reads), 1 and 2 worker processes
  read_bytes_per_s_w{N}           the bytes it delivered per second (as stored for raw inputs)
  loader_samples_per_cpu_s_w{N}   samples per CPU-second spent loading: the CPU time of the
                                  worker processes (getrusage of the joined workers) plus that
                                  of the thread that takes batches from the loader (thread CPU
                                  time: the whole read at w0, the hand-over with workers);
                                  decoding is the device's work and not counted. CPU time is
                                  what a loader core spends, so it holds on a loaded machine
                                  where wall-clock rates do not
  dataloader_samples_per_s_w{1,2} a plain `torch.utils.data.DataLoader` with as many workers over
                                  the same samples, decoding each batch as it arrives; PyTorch's
                                  default collate (exatrain's where the data set reads whole
                                  batches, which PyTorch's cannot take)
  loader_vs_dataloader_w{1,2}     exatrain's loader over the plain one: the median of --repeats
                                  paired ratios (a pass of each in turn, the first alternating)
  loader_vs_dataloader            the lower of the two (>= 1: exatrain's input path costs nothing)
  loader_samples_per_s_cold       1 worker, files evicted from the page cache before each pass
                                  (fsync + posix_fadvise(DONTNEED)): what a first epoch reads
  stage_s, stage_bytes_per_s      copying the data set to node-local storage (/dev/shm) from a
                                  cold page cache
  loader_samples_per_s_staged_cold  1 worker, from the staged copy, its files evicted before
                                  each pass like the cold variant's. On tmpfs (/dev/shm) the
                                  pages are the files and cannot be evicted: there this is a
                                  memory read, as every epoch after staging is
  model_samples_per_s             the model's appetite: steps (forward, backward, optimizer) on
                                  one batch already in memory, one rank's share of the cores
  loader_over_model               loader_samples_per_s at the default workers / appetite (>= 2:
                                  the loader keeps ahead even when the run disturbs it)
  run_data_wait_fraction          a real `exatrain run` of the workload on 2 ranks: median share
                                  of a step spent waiting for input

For CosmoFlow 128³ also: the loader with the transform on the CPU (float32, log1p: the path
before decode on the device), a `space=(1,1,2)` rank's hyperslab reads, the per-core loader rate
`loader_samples_per_s_per_core` (samples per CPU-second with one worker process, the path a GPU
node's ranks take, decode on the device) and `cores_per_gpu`: the loader cores one GPU needs at
`--gpu-rate` samples/s (NVIDIA's MLPerf HPC v3.0 CosmoFlow: about 200 samples/s per H100).

All variants run in one launch on the same files. A pass is one run of a fresh loader over the
same `--samples` samples (spread over the files); rates are medians of `--repeats` passes, after a
warm-up pass for the warm variants. Wall-clock rates count from a pass's first batch (worker
start-up is paid once a run); CPU time counts the whole pass, start-up and shut-down included
(a worker's fork and its first shared-memory buffers: a run pays them once, so short passes
understate the per-core rate of a long run).
`--set [CASE:]KEY=VALUE` changes every case's configuration, or CASE's (e.g. smaller data for a
smoke test).
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

MIN_PASS_S = 0.5  # the shortest paired pass (bench data's loader beside a plain DataLoader)
GPU_RATE = 200.0  # CosmoFlow 128³ samples/s per H100 in NVIDIA's MLPerf HPC v3.0 submission

# (workload, config overrides) for each case: the examples' models, smaller data sets
CASES = {
    "cosmoflow32": ["run.workload=cosmoflow", "data.samples=320"],
    "cosmoflow128": ["run.workload=cosmoflow", "model.size=128", "model.base_channels=32",
                     "model.batchnorm=false", "data.size=128", "data.samples=40",
                     "train.batch_size=4"],
    "deepcam": ["run.workload=deepcam", "model.variant=small", "model.width=16",
                "data.height=96", "data.width=144", "data.samples=96", "model.dropout=0.1"],
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
    parser.add_argument("--samples", type=int, default=512,
                        help="samples per pass (default 512; cold passes: at most the set)")
    parser.add_argument("--real-steps", type=int, default=40,
                        help="steps of the real 2-rank run per workload (0: skip it)")
    parser.add_argument("--gpu-rate", type=float, default=GPU_RATE,
                        help="CosmoFlow 128³ samples/s one GPU takes, for cores_per_gpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="[CASE:]KEY=VALUE",
                        help="a config override for every case, or for CASE only (repeatable)")


def _config(case: str, args, extra: list[str] = ()):
    from ..train.config import load_config
    def for_case(o: str) -> bool:   # "CASE:KEY=VALUE" names its case before the "="
        return ":" not in o.split("=", 1)[0] or o.startswith(f"{case}:")

    mine = [o.split(":", 1)[1] if ":" in o.split("=", 1)[0] else o
            for o in args.overrides if for_case(o)]
    return load_config(None, [*CASES[case], f"data.path={args.data_dir}/{case}", "run.nproc=2",
                              *mine, *extra])


def _mesh():
    from ..mesh import init
    from ..plan import Plan
    return init(Plan())


def _files(path: Path) -> list[Path]:
    from ..data.stage import data_files
    return data_files(path)


def evict(path: Path) -> None:
    """Drop a data set's files from the page cache (flushed first: only clean pages go; a no-op
    on tmpfs, whose pages are the files)."""
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _TimedSource:
    """The loader's iterator, with the CPU time of the thread that takes its batches (the
    prefetch thread): the whole read without workers, the hand-over (unpickling, mapping the
    shared memory) with them."""

    def __init__(self, source):
        self.source, self.cpu_s = source, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.thread_time()
        try:
            return next(self.source)
        finally:
            self.cpu_s += time.thread_time() - start

    def _shutdown_workers(self):  # Prefetcher.close stops the loader's workers through this
        shutdown = getattr(self.source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def loader_pass(workload, dataset, micro: int, workers: int, order: list[int]) -> dict:
    """One pass of a fresh loader (prefetch 2, decode by the workload) over `order`: wall-clock
    samples/s and bytes/s from the first batch on, and the CPU-seconds spent loading (worker
    processes, counted once they are joined, plus the thread taking the batches)."""
    from ..data.loader import Prefetcher, run_loader
    before = _children_cpu_s()
    source = _TimedSource(run_loader(dataset, order, micro, workers, torch.device("cpu"), seed=0))
    feed = Prefetcher(source, torch.device("cpu"), decode=workload.decode, depth=2,
                      workers=workers)
    try:
        next(feed)
        first = micro
        feed.take()
        start, samples = time.perf_counter(), 0
        for batch in feed:
            samples += len(batch[0])
        elapsed = time.perf_counter() - start
    finally:
        feed.close()  # joins the workers: their CPU time is then the children's
    _, size = feed.take()
    cpu = _children_cpu_s() - before + source.cpu_s
    return {"samples_per_s": samples / elapsed, "bytes_per_s": size / elapsed,
            "cpu_s_per_sample": cpu / (samples + first)}


def dataloader_pass(workload, dataset, micro: int, workers: int, order: list[int]) -> dict:
    """One pass of a plain `torch.utils.data.DataLoader` over `order` with `workers` workers,
    the batches decoded as they arrive (what a plain training loop does): wall-clock samples/s
    from the first batch on, as `loader_pass` counts them."""
    from torch.utils.data import DataLoader

    from ..data.batches import plain_collate
    loader = DataLoader(dataset, batch_size=micro, sampler=order, num_workers=workers,
                        collate_fn=plain_collate(dataset), prefetch_factor=2 if workers else None)
    batches = iter(loader)
    try:
        x = next(batches)[0]
        workload.decode_inputs(x)
        start, samples = time.perf_counter(), 0
        for batch in batches:
            workload.decode_inputs(batch[0])
            samples += len(batch[0])
        elapsed = time.perf_counter() - start
    finally:
        del batches
    return {"samples_per_s": samples / elapsed}


def paired_rates(workload, dataset, micro: int, workers: int, samples: int,
                 repeats: int) -> tuple[dict, float, float]:
    """exatrain's loader and a plain DataLoader with `workers` workers, a pass of each in turn
    over the same samples (the first in turn alternating, so that a machine whose speed drifts
    slows both alike), `repeats` pairs after a warm-up pair, each pass `samples` samples or
    `MIN_PASS_S` seconds' worth at the warm-up's rate, whichever is more: the medians of the
    loader's passes (as `loader_rate` gives them), the plain loader's median samples/s, and the
    median of the paired ratios exatrain / plain."""
    n = len(dataset)
    order = [(i * 7919) % n for i in range(max(samples, 3 * micro))]
    dataloader_pass(workload, dataset, micro, workers, order)  # warm-up of both
    rate = loader_pass(workload, dataset, micro, workers, order)["samples_per_s"]
    # a pass long enough to time: QM9's 512 samples took 15 ms, and its ratios spread +-10 %
    count = max(len(order), int(rate * MIN_PASS_S))
    order = [(i * 7919) % n for i in range(count)]
    ours, plain, ratios = [], [], []
    for attempt in range(repeats):
        if attempt % 2:
            theirs = dataloader_pass(workload, dataset, micro, workers, order)["samples_per_s"]
            ours.append(loader_pass(workload, dataset, micro, workers, order))
        else:
            ours.append(loader_pass(workload, dataset, micro, workers, order))
            theirs = dataloader_pass(workload, dataset, micro, workers, order)["samples_per_s"]
        plain.append(theirs)
        ratios.append(ours[-1]["samples_per_s"] / theirs)
    figures = {key: statistics.median(p[key] for p in ours) for key in ours[0]}
    return figures, statistics.median(plain), statistics.median(ratios)


def loader_rate(workload, dataset, micro: int, workers: int, samples: int, repeats: int,
                cold_path: Path | None = None) -> dict:
    """The medians of `repeats` passes (`loader_pass`) over the same `samples` samples (at
    least three batches), spread over the files; warm after an untimed pass, going round the
    data set as often as it takes, or cold: `cold_path` evicted before each pass, each sample
    read once (a smaller pass where the set is smaller)."""
    n = len(dataset)
    count = max(samples if cold_path is None else min(n, samples), 3 * micro)
    order = [(i * 7919) % n for i in range(count)]
    passes = []
    for attempt in range(repeats + (0 if cold_path else 1)):
        if cold_path is not None:
            evict(cold_path)
        figures = loader_pass(workload, dataset, micro, workers, order)
        if cold_path is None and attempt == 0:
            continue
        passes.append(figures)
    return {key: statistics.median(p[key] for p in passes) for key in passes[0]}


def model_rate(workload, config, micro: int, steps: int = 6) -> float:
    """Samples/s of forward + backward + optimizer on one in-memory batch (one rank's share)."""
    from ..optim.factory import build_optimizer
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


def real_run_wait(case: str, args) -> dict:
    """The data_wait_fraction of a real 2-rank `exatrain run` of the case (default workers)."""
    from ..launch import spawn
    steps, out_dir = args.real_steps, str(Path(args.data_dir) / "runs")
    config = _config(case, args, [f"train.steps={steps}", f"train.log_every={steps}",
                                  "train.eval_every=0", f"run.out_dir={out_dir}",
                                  "observe.tensorboard=false", "data.generate=false"])
    return spawn(_real_run, 2, args=(config,))[0]


def _add(out: dict, suffix: str, figures: dict) -> None:
    out[f"loader_samples_per_s_{suffix}"] = figures["samples_per_s"]
    out[f"read_bytes_per_s_{suffix}"] = figures["bytes_per_s"]
    out[f"loader_samples_per_cpu_s_{suffix}"] = 1.0 / figures["cpu_s_per_sample"]


def run_case(case: str, args, mesh) -> dict:
    from ..data.loader import cores_per_rank, default_workers
    from ..data.stage import copy_files, stage_dir
    from ..train.config import micro_batch_size
    from ..workloads import get_workload

    config = _config(case, args)
    module = get_workload(config.run.workload)
    module.prepare(config)
    torch.manual_seed(0)
    workload = module.build(config, mesh)
    micro = micro_batch_size(config, 2)  # a rank's batch in the 2-rank default job
    path = Path(config.data.path)
    out: dict = {"micro_batch": micro}
    warm = {0: loader_rate(workload, workload.train_set, micro, 0, args.samples, args.repeats)}
    _add(out, "w0", warm[0])
    ratios = []
    for workers in (1, 2):  # beside the plain DataLoader with the same workers, passes in turn
        warm[workers], plain, paired = paired_rates(workload, workload.train_set, micro, workers,
                                                    args.samples, args.repeats)
        _add(out, f"w{workers}", warm[workers])
        out[f"dataloader_samples_per_s_w{workers}"] = plain
        out[f"loader_vs_dataloader_w{workers}"] = paired
        ratios.append(paired)
    out["loader_vs_dataloader"] = min(ratios)
    _add(out, "cold", loader_rate(workload, workload.train_set, micro, 1, args.samples,
                                  args.repeats, cold_path=path))
    if args.stage_to:
        with tempfile.TemporaryDirectory(dir=args.stage_to, prefix="exatrain-bench-") as shm:
            evict(path)
            inputs = getattr(module, "input_files", None)
            files = inputs(config) if inputs else None
            start = time.perf_counter()
            staged = copy_files(_files(path) if files is None else
                                files.for_node(0, 1, node_shard=False)[0], path,
                                stage_dir(path, shm))
            out["stage_s"] = time.perf_counter() - start
            out["stage_bytes_per_s"] = staged.copied_bytes / out["stage_s"]
            staged_config = _config(case, args, [f"data.path={staged.path}", "data.generate=false"])
            torch.manual_seed(0)
            staged_workload = module.build(staged_config, mesh)
            _add(out, "staged_cold", loader_rate(staged_workload, staged_workload.train_set, micro,
                                                 1, args.samples, args.repeats,
                                                 cold_path=staged.path))
    threads = torch.get_num_threads()
    torch.set_num_threads(cores_per_rank(2))  # one rank's share, as in the 2-rank job
    try:
        out["model_samples_per_s"] = model_rate(workload, config, micro)
    finally:
        torch.set_num_threads(threads)
    default = default_workers(2)
    out["default_workers"] = default
    out["loader_over_model"] = warm[min(default, 2)]["samples_per_s"] / out["model_samples_per_s"]
    if case == "cosmoflow128":
        out.update(_cosmoflow128_extras(workload, micro, args, warm))
    if args.real_steps:
        out.update({f"run_{k}": v for k, v in real_run_wait(case, args).items()})
    return out


def _cosmoflow128_extras(workload, micro: int, args, warm: dict) -> dict:
    """The CPU-decode path, a spatial rank's hyperslab reads, the cores one GPU needs."""
    from ..parallel.spatial import SpatialBlocks
    data = workload.train_set
    out: dict = {}
    data.raw = False  # the path before decode on the device: float32 + log1p in the loader
    decode, workload.decode = workload.decode, None
    try:
        _add(out, "cpu_decode_w1", loader_rate(workload, data, micro, 1, args.samples,
                                               args.repeats))
    finally:
        data.raw, workload.decode = True, decode
    edge = data.sample_shape[0]
    half = (slice(None), slice(None), slice(0, edge // 2))  # rank 0 of space=(1,1,2)
    _add(out, "space2_w1", loader_rate(workload, SpatialBlocks(data, half), micro, 1,
                                       args.samples, args.repeats))
    # one worker process reads, collates and hands over; per CPU-second of that work
    per_core = 1.0 / warm[1]["cpu_s_per_sample"]
    out["loader_samples_per_s_per_core"] = per_core
    out["loader_bytes_per_s_per_core"] = per_core * warm[1]["bytes_per_s"] / warm[1]["samples_per_s"]
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
    result["loader_vs_dataloader_min"] = min(result[f"{c}_loader_vs_dataloader"] for c in cases)
    return result
