"""The input path of a run: one loader for all epochs, batches a step ahead, the wait measured.

Its parts, each replaceable on its own:

- `EpochSampler` yields this replica's sample indices epoch after epoch (epoch e's order is
  whatever `indices(e, first_step)` says), so a single `DataLoader` serves the whole run and its
  worker processes start once instead of once per epoch;
- `loader_workers` picks the worker processes of a rank from the cores it has (`default_workers`),
  in a launched rank and in a plain process alike (forked, as a plain `DataLoader`'s are);
- `Prefetcher` runs the loader in a background thread, a configurable number of batches ahead:
  it copies each batch to the device (from pinned memory, on its own CUDA stream) and decodes it
  there (`decode`: e.g. int16 particle counts -> log1p -> standardised float32, which moves half
  the bytes of float32 over PCIe and spends no loader core on the arithmetic). The training
  thread's `next()` blocks only for what is not ready yet; that time is `wait_s`, the input wait
  a run reports per step. With `depth = 0` the batch is loaded, copied and decoded on the
  training thread at `next()` (the whole load is then wait). On a CPU with worker processes and
  nothing to decode the workers are the prefetch and there is no thread;
- `collate` hands a worker's batch over in one shared-memory buffer (`packed`; both in
  `data.batches`).

Nothing here communicates; the order of samples is that of the sampler, whatever the number of
workers or the prefetch depth, so resumed and distributed runs see exactly the samples they
would see without it.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import UserError
from .batches import collate

MAX_DEFAULT_WORKERS = 8


def cores_per_rank(local_ranks: int) -> int:
    """The cores this process may run on, shared by the ranks of its node (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def loader_workers(setting: int, local_ranks: int | None = None) -> int:
    """Worker processes per rank for `train.num_workers` = `setting`: itself when ≥ 0, else
    `default_workers` of the ranks on this node (the launcher's local world size; one rank when
    no launcher started this process). The one policy of the Trainer, its evaluation and the
    benchmarks."""
    if setting >= 0:
        return setting
    if local_ranks is None:
        from ..launch import detect
        launch = detect()
        local_ranks = launch.local_world_size if launch else 1
    return default_workers(local_ranks)


def default_workers(local_ranks: int) -> int:
    """Loader worker processes per rank: one core of the rank's share stays with the training
    thread, the rest read and collate, at most 8 (past that, a rank's workers mostly contend for
    the file system). None where a rank has no core to spare (a worker would only take turns with
    the training process on the same core; the prefetch thread then reads a step ahead, and HDF5
    and numpy release the GIL while they read) and none in a daemonic process (a rank started by
    a multiprocessing pool may not have children)."""
    if multiprocessing.current_process().daemon:
        return 0
    return max(0, min(MAX_DEFAULT_WORKERS, cores_per_rank(local_ranks) - 1))


class EpochSampler(Sampler):
    """Indices of one replica for every step from `first_step` on, epoch after epoch, for ever.

    `indices(epoch, first_step)` returns the replica's indices for steps first_step.. of `epoch`;
    the sampler concatenates epochs, so a `DataLoader` over it never has to be rebuilt."""

    def __init__(self, indices: Callable[[int, int], list[int]], steps_per_epoch: int,
                 start_step: int):
        self.indices = indices
        self.epoch, self.offset = divmod(start_step, steps_per_epoch)

    def __iter__(self):
        epoch, offset = self.epoch, self.offset
        while True:
            yield from self.indices(epoch, offset)
            epoch, offset = epoch + 1, 0


def batch_bytes(batch) -> int:
    """Bytes of the tensors in a batch (tuples, lists and dicts of tensors), as delivered."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(batch_bytes(b) for b in batch.values())
    return 0


def _to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _record_stream(batch, stream) -> None:
    """Tell the CUDA allocator the training stream uses tensors made on the copy stream."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record_stream(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _record_stream(b, stream)


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


def _side_thread_intra_op() -> None:
    """Torch ops of this side thread run on one core. With OpenMP (Linux builds), a second
    thread that has run a parallel op keeps its own team of OpenMP threads alive while it lives,
    and every parallel op of the training thread then ran 2.4x slower on 2 cores (a BatchNorm
    forward and backward, 120 against 285 µs; DeepCAM's small step 4 against 15 ms), even with the
    side thread blocked. OpenMP's thread count is per thread, so the training thread keeps its
    own; other backends share one count, which is left alone."""
    if "OpenMP" in torch.__config__.parallel_info():
        torch.set_num_threads(1)


class Prefetcher:
    """Batches of `source` on `device`, `depth` batches ahead, decoded by `decode(x)` there.

    Who decodes: on a GPU the prefetch thread (the copy and the decode overlap the step). On a
    CPU, the training thread as it takes the batch when it runs torch on several cores
    (`torch.get_num_threads() > 1`, an in-process run: it decodes with all of them, as a plain
    loop does, where the prefetch thread would decode on one core beside them: CosmoFlow 128³'s
    loader ran at 0.86x a plain DataLoader so), else the prefetch thread (a rank of a launched
    job has one core: there the decode fills the rank's waits for its peers' collectives).

    Whether there is a prefetch thread at all: not on a CPU where `source` has worker processes
    (`workers` > 0) and there is nothing to decode. The workers are then the prefetch (a
    DataLoader keeps two batches per worker in flight) and the thread would only move each batch
    from one queue to another, a hand-over that cost QM9's loader 4 % beside a plain DataLoader.
    With a decode on the training thread the thread takes the next batch over from the workers
    meanwhile (mapping its shared memory): without it, DeepCAM's and CosmoFlow's loaders fell to
    0.75-0.95x a plain DataLoader's rate.

    Items of `source` are `(x, y)` pairs (or any nest of tensors: then only `x = batch[0]` is
    decoded). `wait_s` accumulates the seconds `next()` blocked (a decode on the training thread
    included); `bytes` the bytes delivered (as read, before decoding); `take()` returns and
    resets both, once per step.
    """

    def __init__(self, source: Iterator, device: torch.device, decode: Callable | None = None,
                 depth: int = 2, workers: int = 0):
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0 (0 = load on the training thread)")
        self.source, self.device, self.decode, self.depth = source, device, decode, depth
        self.cuda = device.type == "cuda"
        self.decode_on_take = not self.cuda and torch.get_num_threads() > 1
        self.wait_s, self.bytes = 0.0, 0
        self._stop = threading.Event()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if depth > 0 and not (self.decode_on_take and workers > 0 and decode is None):
            self._queue = queue.Queue(maxsize=depth)
            self._stream = torch.cuda.Stream(device) if self.cuda else None
            self._thread = threading.Thread(target=self._fill, name="exatrain-prefetch", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ producer
    def _decoded(self, batch):
        if self.decode is not None and isinstance(batch, (list, tuple)) and batch:
            batch = type(batch)((self.decode(batch[0]), *batch[1:]))
        return batch

    def _ready(self, batch, stream=None, decode: bool = True):
        """One host batch -> (device batch, its bytes, the event that marks it ready)."""
        size = batch_bytes(batch)
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            batch = _to_device(batch, self.device)
            if decode:
                batch = self._decoded(batch)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        return batch, size, event

    def _fill(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        _side_thread_intra_op()
        try:
            for batch in self.source:
                if not self._put(self._ready(batch, self._stream,
                                             decode=not self.decode_on_take)):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the training thread, raised at its next()
            self._put(_Failed(exc))

    def _put(self, item) -> bool:
        """Queue `item` once there is room; False when the consumer stopped first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # ------------------------------------------------------------------ consumer
    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        if self._thread is None:  # no thread: everything on this one, all of it wait
            batch, size, _ = self._ready(next(self.source))
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
        else:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)
                raise StopIteration
            if isinstance(item, _Failed):
                raise item.exc
            batch, size, event = item
            if self.decode_on_take:
                batch = self._decoded(batch)
            if event is not None:
                # the training stream waits for the copy on the device; the host does not (a
                # copy still running shows in the step's device time, not in wait_s)
                torch.cuda.current_stream(self.device).wait_event(event)
                _record_stream(batch, torch.cuda.current_stream(self.device))
        self.wait_s += time.perf_counter() - start
        self.bytes += size
        return batch

    def take(self) -> tuple[float, int]:
        """(seconds waited, bytes delivered) since the last call."""
        out = (self.wait_s, self.bytes)
        self.wait_s, self.bytes = 0.0, 0
        return out

    def close(self) -> None:
        """Stop the thread and the loader's workers (a failed or finished run leaves none)."""
        self._stop.set()
        if self._thread is not None:
            while True:  # unblock a producer waiting to put
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=30)
        shutdown = getattr(self.source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


def run_loader(dataset, sampler: Sampler, batch_size: int, workers: int, device: torch.device,
               seed: int, collate_fn=None, timeout_s: float = 0.0) -> Iterator:
    """A `DataLoader` iterator over `sampler` in micro-batches of `batch_size` (workers persist for
    as long as the iterator lives; pinned memory for CUDA copies). With workers, `timeout_s` > 0
    bounds the wait for any one batch: a worker that hangs or died silently becomes an error that
    says so (`LoaderTimeout`), not a run that waits forever."""
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", collate_fn=collate_fn or collate,
                        prefetch_factor=2 if workers > 0 else None,
                        timeout=timeout_s if workers > 0 else 0,
                        # its own generator: starting the loader must not draw from the global
                        # RNG, or dropout after a resume would differ
                        generator=torch.Generator().manual_seed(seed),
                        worker_init_fn=leave_signals_to_the_rank)
    with no_inherited_garbage(workers):
        iterator = iter(loader)   # starts the workers
    if workers > 0:
        return _WorkerBatches(iterator, workers, timeout_s)
    return iterator


def leave_signals_to_the_rank(worker_id: int) -> None:
    """A loader worker leaves the signals a launcher sends to its rank's process group
    (torchrun's agent when the nodes change, Slurm's wall-time warning: SIGTERM, SIGUSR1) to the
    rank, which finishes its step, saves a checkpoint and then ends its workers itself: a worker
    that died of the signal would fail that step. So the worker takes a process group of its
    own, and, so that it never outlives its rank, on Linux the kernel kills it when the rank's
    process ends (prctl PR_SET_PDEATHSIG)."""
    os.setpgrp()
    if sys.platform == "linux":
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def no_inherited_garbage(workers: int):
    """Forked workers must not collect the parent's garbage. A process group left in a reference
    cycle (a run that ended, an earlier `init`) is garbage the parent has not collected yet; a
    forked worker's collector destroyed it, and gloo's destructor waited for threads that do not
    exist in the child: the worker hung for ever. So the parent freezes every object it holds,
    its garbage included, while the workers fork (the collector of a child never examines frozen
    objects; also spares copy-on-write of every object's header), and unfreezes them once the
    workers started: the garbage is left to the parent's own collector. Freezing and unfreezing
    move whole generations (constant time); a full collection here instead cost 0.24 s per
    loader start once torch is imported."""
    if workers == 0 or multiprocessing.get_context().get_start_method() != "fork":
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LoaderTimeout(UserError, RuntimeError):
    """No batch came from the input loader's worker processes within `run.timeout_s`.

    What to do: check the data path (a hung file system, a data set that blocks); set
    `train.num_workers = 0` to read on the prefetch thread, or raise `run.timeout_s`; see
    [feed the model](../how-to/data-path.md#the-loader).
    """


class _WorkerBatches:
    """A DataLoader iterator over worker processes whose errors read as if the data set had been
    read in this process: a timeout names the setting and the fixes (`LoaderTimeout`), and a
    `UserError` a worker raised (a `DataError` naming file and sample) keeps its message alone.
    DataLoader re-raises a worker's exception as a new one of its class whose message is the
    worker's whole traceback ("Caught DataError in DataLoader worker process 0. Original
    Traceback ..."); a user is told what is wrong with their data in one line, as without
    workers, and the worker's traceback stays in the error's __cause__."""

    def __init__(self, batches: Iterator, workers: int, timeout_s: float):
        self.batches, self.workers, self.timeout_s = batches, workers, timeout_s

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.batches)
        except UserError as exc:
            raise _as_raised_in_worker(exc) from exc
        except RuntimeError as exc:
            # DataLoader's own timeout has no type of its own
            if self.timeout_s <= 0 or "timed out" not in str(exc):
                raise
            raise LoaderTimeout(
                f"the input loader's {self.workers} worker process(es) delivered no batch in "
                f"{self.timeout_s:g} s (run.timeout_s): a worker is stuck reading (a slow or hung "
                "file system, a data set that blocks) or was forked from a process whose threads "
                "it cannot use. Check the data path, set train.num_workers=0 to read on the "
                "prefetch thread instead, or raise run.timeout_s for first reads that are this "
                "slow.") from exc

    def _shutdown_workers(self) -> None:   # what Prefetcher.close calls on a DataLoader iterator
        self.batches._shutdown_workers()


def _as_raised_in_worker(exc: UserError) -> UserError:
    """The error a worker raised, with its own message: the last line of the traceback that
    DataLoader put in `exc`'s message (`module.Class: message`); `exc` itself when its message
    is not such a traceback."""
    text, cls = str(exc), type(exc)
    marker = f"{cls.__module__}.{cls.__qualname__}: "
    if not text.startswith("Caught ") or marker not in text:
        return exc
    try:
        return cls(text.rsplit(marker, 1)[1].rstrip("\n"))
    except TypeError:   # a subclass whose constructor takes more than the message
        return exc
