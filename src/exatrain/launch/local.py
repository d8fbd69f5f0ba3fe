"""Spawn N local ranks on this machine (`exatrain run --nproc N`, and the test harness).

Each child gets the env:// variables torchrun would give it, runs `fn(*args)`, and pickles its
result (or its traceback) to a file.

Ranks are forked from a forkserver (multiprocessing's "forkserver" start method) that imported
torch and exatrain once, not started as fresh interpreters that each import torch: on this 2-core
machine two ranks started in 0.3 s instead of 3 s, and a restart after a failure is as quick. It
also imports torch._dynamo, which torch's optimizers import when the first one is built (1.5 s
of each rank's start otherwise, whether or not anything is compiled). The
server is a single-threaded process that never touched a GPU, so forking it is safe where forking
the caller (threads, CUDA) is not. A forked rank would see the server's environment, working
directory and import path, taken when the server started; the caller's current ones are sent
with every launch and set before `fn` and its arguments are unpickled. EXATRAIN_START_METHOD=spawn
goes back to fresh interpreters. Each rank also gets the caller's multiprocessing start method
back (a forkserver's child would otherwise start its own children, the loader's workers, from a
forkserver of its own, which imports the script again as its main module: a script without a
`__main__` guard then trained again inside it and hung; under torchrun they fork, and here too).
The parent watches all children: when one fails, the others
are given a short grace period (they may be blocked in a collective waiting for the dead rank)
and then stopped, and the parent raises `RankFailed` naming the rank and carrying its traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .env import LaunchError


class RankFailed(RuntimeError):
    """A spawned rank raised; `.rank` is which, the message ends with its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(message + (f"\n\n--- traceback on rank {rank} ---\n{remote_traceback}"
                                    if remote_traceback else ""))


def describe_exit(code: int | None) -> str:
    """"killed by SIGKILL" / "exit code 3" for a process exit code (negative: a signal)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# A rank that dies without raising (a signal, os._exit) is seen by the parent's poll up to one
# poll later than its peers raise "connection reset"; this slack keeps the dead rank the cause.
_POLL_S = 0.05
_DEATH_SLACK_S = 1.0


def _forward_signals(procs) -> dict:
    """Pass SIGTERM / SIGUSR1 (a batch system's wall-time warning) on to every rank; returns the
    previous handlers. Only the main thread may set handlers; elsewhere nothing is forwarded."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, _frame):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


START_METHOD_ENV = "EXATRAIN_START_METHOD"
SPAWNED_ENV = "EXATRAIN_LOCAL_SPAWN"  # set in the ranks spawn() starts: no outside launcher


def rank_context():
    """The start method's context: forkserver with torch, torch._dynamo and exatrain preloaded
    (spawn where EXATRAIN_START_METHOD says so, or where the platform has no forkserver)."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise LaunchError(f"{START_METHOD_ENV}={method!r}: use 'forkserver' (the default: ranks "
                          "forked from a process that imported torch once) or 'spawn' (fresh "
                          "interpreters).")
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["exatrain.launch.preload"])  # collector paused, then frozen
    return ctx


# variables torch, torch._dynamo and torch._inductor read once, when the forkserver imports them
_READ_AT_IMPORT = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS")
# but this one is read at every use, and torch writes it itself (its default) as it first
# compiles or traces: a caller that compiled before launching has it, and its ranks use it
_READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)


def stale_compile_settings(server: dict, caller: dict) -> str | None:
    """What a forked rank would silently ignore: compile and logging variables the caller set
    or changed after the forkserver started (torch read them as it imported); None when none."""
    names = sorted(k for k in {*server, *caller} if k.startswith(_READ_AT_IMPORT)
                   and k not in _READ_WHEN_USED and server.get(k) != caller.get(k))
    if not names:
        return None
    return (f"{', '.join(names)} changed after this process's first local launch; its ranks "
            "fork from a server that imported torch before, so they keep the earlier values. Set "
            "them before the first launch, or EXATRAIN_START_METHOD=spawn (fresh interpreters).")


def _child(payload: bytes, environ: dict, import_path: list, cwd: str, start_method: str,
           rank: int, nproc: int, port: int, threads: int, result_dir: str) -> None:
    # the caller's process state at launch time (a forked rank starts with the server's, and
    # multiprocessing set this process's start method to the one that started it)
    multiprocessing.set_start_method(start_method, force=True)
    stale = stale_compile_settings(os.environ, environ)
    if stale and rank == 0:
        print(f"exatrain: {stale}", file=sys.stderr, flush=True)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      **{SPAWNED_ENV: "1"})
    sys.path[:] = import_path
    os.chdir(cwd)
    import torch

    torch.set_num_threads(threads)
    path = Path(result_dir) / f"rank{rank}.pkl"
    try:
        fn, args = pickle.loads(payload)  # after sys.path: fn may live in the caller's modules
        outcome = ("ok", fn(*args))
    except BaseException as exc:  # report every failure, including KeyboardInterrupt
        # the time tells the root cause from its echoes: when one rank raises, its peers fail
        # afterwards with "connection reset" in whatever collective they were waiting in
        outcome = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), exc, time.time())
        try:   # the parent must unpickle it too (its class decides exit status 2 or 1)
            pickle.loads(pickle.dumps(outcome))
        except Exception:
            outcome = outcome[:3] + (None, outcome[4])
    with open(path.with_suffix(".tmp"), "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path.with_suffix(".tmp"), path)
    if outcome[0] == "error":
        os._exit(1)
    from .teardown import tear_down
    tear_down()   # meshes keep a launched job's group (Mesh.close); the rank ends here


def spawn(fn, nproc: int, args: tuple = (), timeout_s: float | None = None,
          grace_s: float = 10.0, env: dict | None = None) -> list:
    """Run `fn(*args)` on `nproc` spawned ranks; return the list of their results by rank.

    `fn` must be importable (a module-level function). Threads per rank = cores // nproc (≥1), so
    ranks do not oversubscribe the cores.
    """
    threads = max(1, (os.cpu_count() or 1) // nproc)
    ctx = rank_context()
    port = free_port()
    payload = pickle.dumps((fn, tuple(args)))
    environ = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="exatrain-spawn-") as result_dir:
        start_method = multiprocessing.get_start_method()   # the caller's (the platform's default)
        procs = [ctx.Process(target=_child, args=(payload, environ, list(sys.path), os.getcwd(),
                                                  start_method, r, nproc, port, threads,
                                                  result_dir),
                             daemon=False)
                 for r in range(nproc)]
        for p in procs:
            p.start()
        start = time.monotonic()
        first_failure: float | None = None
        died_at: dict[int, float] = {}   # wall time the parent saw each failed rank gone
        previous_handlers = _forward_signals(procs)
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in died_at:
                        died_at[r] = time.time() - _POLL_S - _DEATH_SLACK_S
                if died_at and first_failure is None:
                    first_failure = now
                if first_failure is not None and now - first_failure > grace_s:
                    break
                if timeout_s is not None and now - start > timeout_s:
                    raise RankFailed(-1, f"{nproc} spawned ranks did not finish within {timeout_s:.0f} s; "
                                         "a rank is probably stuck in a collective the others never "
                                         "joined. Raise the timeout or look for unequal work per rank.")
                time.sleep(_POLL_S)
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            stopped_by_us = {r for r, p in enumerate(procs) if p.is_alive()}
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        results, errors = [], []
        for rank, p in enumerate(procs):
            path = Path(result_dir) / f"rank{rank}.pkl"
            if not path.exists():
                if rank in stopped_by_us:
                    why, when = "stopped after another rank failed", float("inf")
                else:  # died on its own: a signal (SIGKILL: killed or out of memory) or os._exit
                    why, when = describe_exit(p.exitcode), died_at.get(rank, float("inf"))
                errors.append((rank, f"rank {rank} died ({why}) without raising an exception",
                               "", None, when))
                results.append(None)
                continue
            with open(path, "rb") as f:
                outcome = pickle.load(f)
            if outcome[0] == "ok" and p.exitcode not in (0, None) and rank not in stopped_by_us:
                # its work done, the rank did not exit cleanly (an abort in its teardown): under
                # srun that is a failed task, so here too
                errors.append((rank, f"rank {rank} returned its result, then ended with "
                               f"{describe_exit(p.exitcode)} instead of exiting cleanly", "", None,
                               died_at.get(rank, float("inf"))))
                results.append(None)
            elif outcome[0] == "ok":
                results.append(outcome[1])
            else:
                errors.append((rank,) + tuple(outcome[1:]))
                results.append(None)
        if errors:
            errors.sort(key=lambda e: (e[4], e[0]))  # the first failure is the cause
            rank, message, tb, exc, _ = errors[0]
            failure = RankFailed(rank, f"rank {rank} of {nproc} failed: {message}", tb)
            failure.original = exc
            raise failure
        return results
