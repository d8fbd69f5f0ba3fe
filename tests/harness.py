"""Run a function on N gloo ranks and compare results with serial runs.

Starting a rank costs seconds (a fresh interpreter importing torch), and the suite launches
dozens of multi-rank cases, so ranks are kept in a pool per world size for the whole session,
and a pool's ranks are forked from a forkserver that imported torch once.
Each call gets a fresh rendezvous (env:// variables with a new port), so the function under test
creates and destroys its own process group exactly as under a real launcher. When a rank fails,
the others get a grace period (they may be blocked in a collective with the dead rank), then the
pool is torn down and rebuilt, and `RankFailed` is raised with the failing rank's traceback.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch

from exatrain.launch.local import RankFailed, free_port, rank_context


def true_fp32_on_cuda() -> None:
    """With EXATRAIN_SHARE_GPU=1 the ranks and the serial reference compute on the GPU: compare
    them in true float32 (cuDNN's convolutions default to TF32, which moves a loss by ~1e-4,
    above the 1e-5 these tests hold)."""
    if os.environ.get("EXATRAIN_SHARE_GPU") == "1":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


def on_cpu(value):
    """A rank's result with its tensors on the CPU: compared with the serial run's there."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(on_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    return value


def _worker(rank: int, world_size: int, tasks, results, stacks: str) -> None:
    import torch as _torch

    from exatrain.launch.host_memory import keep_freed_host_memory

    _torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # a rank that misses its deadline writes every thread's stack before it is killed, and a
    # rank that crashes in native code (a segfault, an abort) writes its Python stack: into a
    # file of its own, which the failure's message carries (a forked rank's stderr is the
    # forkserver's, which no test captures)
    stack_file = open(stacks, "w")  # noqa: SIM115 -- open for the process's lifetime
    # SIGUSR2: SIGUSR1 is a stop signal to the Trainer (a scheduler's wall-time warning), whose
    # handler would take it over during a fit and leave it at its default (death) after one
    faulthandler.register(signal.SIGUSR2, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)
    keep_freed_host_memory()  # as `exatrain run` sets up each rank (run.host_memory = "keep")
    true_fp32_on_cuda()
    # torch's TCPStore names every peer with getnameinfo: a reverse DNS query for
    # ::ffff:127.0.0.1 (the v4-mapped address, which /etc/hosts does not list), client and server
    # side. Where the resolver drops a query (this sandbox's does about 1 in 50), glibc waits its
    # default 5 s and the whole rendezvous with it (measured: 1 in 4 rendezvous of 8 ranks).
    # 1 s and no retry instead: the failed lookup also makes torch stop asking for the rest of
    # the process's life (it then prints numeric addresses), so a rank pays it at most once.
    os.environ["RES_OPTIONS"] = f"{os.environ.get('RES_OPTIONS', '')} timeout:1 attempts:1".strip()
    # what the rank imported is never garbage: every collection below (the one after each test
    # costs 0.2 s instead of 0.002 s with torch's objects in it) skips it
    gc.freeze()
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args, port = task
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        try:
            results.put(_pickled((rank, "ok", on_cpu(fn(*args)), "", 0.0)))
        except BaseException as exc:  # report every failure, with its time: the first is the cause
            results.put(_pickled((rank, "error", exc, traceback.format_exc(), time.time())))
        finally:
            import torch.distributed as dist
            if dist.is_initialized():  # a failed test must not leak its group into the next
                dist.destroy_process_group()
            del task, fn, args
            gc.collect()  # frees the test's subgroups that only reference cycles kept alive


def _pickled(report: tuple) -> bytes:
    """`report` pickled here, once: the queue would pickle it in a thread of its own, where a
    value that does not pickle is dropped without a word and the test would wait for a result
    that never comes. Such a value is reported as an error that says why."""
    try:
        return pickle.dumps(report)
    except Exception as exc:  # noqa: BLE001 - any reason it cannot travel
        rank, status, value, tb, when = report
        what = "its result" if status == "ok" else f"its {type(value).__name__}: {value}"
        return pickle.dumps((rank, "error", RuntimeError(
            f"rank {rank} could not send {what} to the test ({type(exc).__name__}: {exc})"),
            tb, when or time.time()))


class _Pool:
    def __init__(self, world_size: int):
        # forked from a server that imported torch and exatrain once, as exatrain's own local
        # ranks are (launch.local): a pool of 4 starts in 0.3 s instead of 3 s of four
        # interpreters importing torch on 2 cores; a rank is as fresh as a spawned one
        ctx = rank_context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        # not daemonic: a rank's data loader starts worker processes, as under a real launcher
        # (the pools are killed at exit by _close_pools, which runs before multiprocessing's own
        # exit handler joins children)
        self.stacks = Path(tempfile.mkdtemp(prefix=f"exatrain-ranks{world_size}-"))
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.tasks[r], self.results,
                                                        str(self.stacks / f"rank{r}.txt")),
                                  daemon=False) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout_s: float, grace_s: float = 10.0) -> list:
        port = free_port()
        for q in self.tasks:
            q.put((fn, args, port))
        out: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        grace_until = None   # once a rank failed, the others get grace_s to report theirs
        while len(out) < self.world_size:
            failed = any(o[0] == "error" for o in out.values())
            if failed and grace_until is None:
                grace_until = time.monotonic() + grace_s
            until = grace_until if failed else deadline
            try:  # in slices of a second: a rank that died is noticed at once, not at the deadline
                rank, status, value, tb, when = pickle.loads(self.results.get(
                    timeout=max(0.1, min(until - time.monotonic(), 1.0))))
                out[rank] = (status, value, tb, when)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in out]
                if dead or time.monotonic() >= until:
                    if not failed and not dead:
                        self.dump_stacks()
                    what = f"rank {dead[0]} died ({self.exit_status(dead[0])})" if dead else \
                        f"no result within {timeout_s:.0f} s (a rank is stuck in a collective)"
                    what += self.stacks_text()
                    self.close()
                    if not failed:
                        raise RankFailed(dead[0] if dead else -1, f"{fn.__name__}: {what}")
                    break
        errors = sorted((o[3], r) for r, o in out.items() if o[0] == "error")
        if errors:
            rank = errors[0][1]
            _, exc, tb, _ = out[rank]
            failure = RankFailed(rank, f"rank {rank} of {self.world_size} failed: "
                                       f"{type(exc).__name__}: {exc}", tb)
            failure.original = exc
            raise failure
        return [out[r][1] for r in range(self.world_size)]

    def dump_stacks(self) -> None:
        """Every rank's threads' stacks on its stderr: where a stuck rank waits."""
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR2)
        time.sleep(1.0)

    def exit_status(self, rank: int) -> str:
        code = self.procs[rank].exitcode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stacks_text(self) -> str:
        """What the ranks' fault handlers wrote: a crashed rank's stack, a stuck rank's threads."""
        parts = []
        for path in sorted(self.stacks.glob("rank*.txt")):
            text = path.read_text(errors="replace").strip()
            if text:
                parts.append(f"\n--- {path.stem}'s stacks ---\n{text[-6000:]}")
        return "".join(parts)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def threads(self) -> int:
        """The most threads any rank process holds (Linux; 0 where /proc cannot tell)."""
        try:
            return max(len(os.listdir(f"/proc/{p.pid}/task")) for p in self.procs)
        except OSError:
            return 0

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        shutil.rmtree(self.stacks, ignore_errors=True)


_pools: dict[int, _Pool] = {}  # test-session cache of rank pools, keyed by world size
# Gloo's threads of the groups earlier tests made outlive destroy_process_group where something
# still references the group; their TCP loops then spin on the closed sockets (measured: 600-900
# threads and a quarter of a core per idle rank process late in the suite). Past this many
# threads a pool is replaced by fresh processes (a few seconds) rather than kept burning CPU.
MAX_POOL_THREADS = 150


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()


def run_ranks(world_size: int, fn, *args, timeout_s: float = 300.0, fresh: bool = False) -> list:
    """`fn(*args)` on `world_size` gloo ranks (env:// set); returns the results by rank.

    `fresh=True` starts new rank processes first: for a launch that must not inherit what earlier
    tests left in torch's process-wide caches (see the caller).
    """
    # a device run with little time caps every case's wait (the stacks then say where it hung)
    timeout_s = min(timeout_s, float(os.environ.get("EXATRAIN_TEST_RANK_TIMEOUT_S", timeout_s)))
    if fresh and world_size in _pools:
        _pools.pop(world_size).close()
    pool = _pools.get(world_size)
    if pool is not None and pool.threads() > MAX_POOL_THREADS:
        _pools.pop(world_size).close()
        pool = None
    if pool is None or not pool.alive():
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, timeout_s)
    except RankFailed:
        if not pool.alive():
            _pools.pop(world_size, None)
        raise


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error of `a` against reference `b`."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def max_rel_err_state(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_err(a[k], b[k]) for k in a)


def logged_losses(run_dir) -> dict[int, float]:
    """step -> training loss, from a run directory's metrics.jsonl."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def interrupted_copy(run_dir, dest, stopped_at: int, later: int):
    """A copy of a finished run as if it had stopped right after the checkpoint of `stopped_at`:
    the later checkpoint `later` and the metrics after `stopped_at` are gone."""
    import json
    import shutil
    from pathlib import Path

    dest = Path(dest)
    shutil.copytree(run_dir, dest)
    shutil.rmtree(dest / "checkpoints" / f"step_{later:08d}")
    (dest / "checkpoints" / "latest").write_text(f"step_{stopped_at:08d}")
    kept = [line for line in (dest / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] <= stopped_at]
    (dest / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    return dest
