"""Staging: copy a data set once per node from the parallel file system to node-local storage.

MLPerf HPC's record runs staged CosmoFlow and DeepCAM into node-local storage before training and
logged it as its own phase; reading every epoch from Lustre/GPFS is the most common reason a job
waits for its input. `stage_files` copies the given files of `source` into
`DIR/exatrain-stage/<name>-<hash of the source path>/`, keeping their relative paths:

- one copier per node (the node's lowest rank); the node's other ranks wait for it, and every
  rank learns every copier's outcome, so a failure on one node stops all ranks with its message
  instead of leaving them in a collective;
- before any byte moves: `DIR` must exist, be writable and have the free bytes the copy needs;
- every copied file is checksummed (CRC-32 of the source bytes as read, then of the copy as
  written and read back) and recorded in `.exatrain-stage.json` with the source's size and
  modification time; a later run reuses a copy whose source is unchanged and whose bytes still
  have the recorded checksum, and copies again one that does not (a corrupted or partial copy);
- files are written under a temporary name and renamed, so an interrupted copy is never reused.

Communication: two all-gathers of small Python objects over the world (host names; outcomes).
Bytes read from the file system: each file once per node (instead of once per epoch per rank).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = ".exatrain-stage.json"
CHUNK = 8 << 20
STAGE_ENV = "EXATRAIN_STAGE_TO"  # a batch script's override of data.stage_to
HOST_ENV = "EXATRAIN_HOST"       # pretend host name (tests: several "nodes" on one machine)


class StagingError(RuntimeError):
    """The stage directory cannot take the data set; the message says what to do."""


@dataclass
class StageResult:
    path: Path                      # where the staged data set is (replaces data.path)
    files: int = 0
    copied_bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        return {"stage_s": self.seconds, "staged_bytes": self.copied_bytes + self.reused_bytes,
                "stage_copied_bytes": self.copied_bytes, "stage_reused_bytes": self.reused_bytes,
                "stage_files": self.files, "staged_to": str(self.path)}


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def stage_dir(source: Path, stage_to: Path) -> Path:
    """The directory of `source`'s copy under `stage_to` (one per data set path)."""
    source = Path(source).resolve()
    tag = hashlib.sha1(str(source).encode()).hexdigest()[:10]
    return Path(stage_to) / "exatrain-stage" / f"{source.name}-{tag}"


def data_files(source: Path) -> list[Path]:
    """Every regular file of a data set: the file itself, or all files under the directory."""
    source = Path(source)
    if source.is_file():
        return [source]
    return sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith("."))


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _copy(src: Path, dst: Path) -> int:
    """Copy src to dst (through a temporary name); returns the CRC-32 of the bytes read."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    crc = 0
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
                fout.write(chunk)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return crc


def check_stage_dir(stage_to: Path, need_bytes: int, rank: int) -> None:
    """Refuse, before copying, a stage directory that is missing, read-only or too small."""
    stage_to = Path(stage_to)
    where = f"data.stage_to={stage_to} (or ${STAGE_ENV}) on rank {rank}, host {host_name()}"
    if not stage_to.is_dir():
        raise StagingError(f"{where}: no such directory. Create it in the batch script "
                           "(mkdir -p), or point it at node-local storage that exists: /dev/shm, "
                           "$TMPDIR, a node-local NVMe mount.")
    probe = stage_to / f".exatrain-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StagingError(f"{where}: not writable ({exc.strerror}). Choose a directory this "
                           "user can write on every node (/dev/shm, $TMPDIR).") from None
    free = shutil.disk_usage(stage_to).free
    if free < need_bytes:
        raise StagingError(f"{where}: {_human(free)} free, the copy needs {_human(need_bytes)}. "
                           "Free space there, use a larger node-local directory, or set "
                           "data.shuffle = \"node\" so each node stages only its shard.")


def _manifest(dest: Path) -> dict:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def copy_files(files: list[Path], source: Path, dest: Path, rank: int = 0,
               progress=None) -> StageResult:
    """Copy `files` (under `source`) into `dest`, reusing verified copies (this process only)."""
    start = time.perf_counter()
    source = Path(source)
    base = source if source.is_dir() else source.parent
    manifest = _manifest(dest) if dest.is_dir() else {}
    result = StageResult(path=dest / source.name if source.is_file() else dest, files=len(files))
    plan = []
    for src in files:
        rel = str(Path(src).relative_to(base))
        stat = src.stat()
        entry = manifest.get(rel)
        target = dest / rel
        same_source = entry and entry["size"] == stat.st_size and entry["mtime_ns"] == stat.st_mtime_ns
        plan.append((src, rel, stat, target, same_source))
    need = sum(stat.st_size for _, _, stat, target, same in plan
               if not (same and target.is_file() and target.stat().st_size == stat.st_size))
    check_stage_dir(dest.parents[1], need, rank)
    dest.mkdir(parents=True, exist_ok=True)
    done = 0
    total = sum(stat.st_size for _, _, stat, _, _ in plan)
    for src, rel, stat, target, same_source in plan:
        if same_source and target.is_file() and target.stat().st_size == stat.st_size \
                and crc32_file(target) == manifest[rel]["crc32"]:
            result.reused.append(rel)
            result.reused_bytes += stat.st_size
        else:  # new, changed at the source, or a corrupted copy: copy (again) and verify
            crc = _copy(src, target)
            if crc32_file(target) != crc:
                raise StagingError(f"{target}: the copy's checksum differs from {src}'s on rank "
                                   f"{rank}, host {host_name()}: the stage directory is failing; "
                                   "choose another (data.stage_to).")
            manifest[rel] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "crc32": crc}
            (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
            result.copied.append(rel)
            result.copied_bytes += stat.st_size
        done += stat.st_size
        if progress is not None:
            progress(done, total, rel)
    result.seconds = time.perf_counter() - start
    return result


def stage_files(source: Path, stage_to: Path, mesh, files: list[Path] | None = None,
                verbose: bool = True) -> StageResult:
    """Collective over the mesh's world: each node's lowest rank copies `files` (default: all of
    `source`) into node-local `stage_to`; every rank returns the staged path and the figures."""
    from ..comm import all_gather_object

    start = time.perf_counter()
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"data.path={source}: nothing to stage (no such file or directory).")
    hosts = all_gather_object(host_name(), mesh.world)
    me = mesh.rank
    copier = hosts.index(hosts[me]) == me  # the node's lowest rank
    dest = stage_dir(source, stage_to)
    outcome: dict = {"rank": me, "host": hosts[me]}
    result = StageResult(path=dest / source.name if source.is_file() else dest)
    if copier:
        try:
            chosen = data_files(source) if files is None else [Path(f) for f in files]
            show = verbose and me == 0
            if show:
                size = sum(f.stat().st_size for f in chosen)
                print(f"exatrain: staging {len(chosen)} files ({_human(size)}) of {source} to "
                      f"{dest} on {len(set(hosts))} node(s)", file=sys.stderr, flush=True)
            result = copy_files(chosen, source, dest, me, _progress_printer() if show else None)
            outcome.update(result.figures())
        except Exception as exc:  # every rank must hear of it, or the others wait for ever
            outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcomes = all_gather_object(outcome, mesh.world)
    failed = [o for o in outcomes if "error" in o]
    if failed:
        raise StagingError("staging failed on " + "; ".join(
            f"rank {o['rank']} (host {o['host']}): {o['error']}" for o in failed))
    mine = next(o for o in outcomes if o["host"] == hosts[me] and "stage_s" in o)
    result.copied_bytes, result.reused_bytes = mine["stage_copied_bytes"], mine["stage_reused_bytes"]
    result.files = mine["stage_files"]
    result.seconds = time.perf_counter() - start  # the node's copy, as this rank waited for it
    if verbose and me == 0:
        rate = result.copied_bytes / max(result.seconds, 1e-9)
        print(f"exatrain: staged in {result.seconds:.1f} s: copied {_human(result.copied_bytes)} "
              f"({_human(rate)}/s), reused {_human(result.reused_bytes)} verified", file=sys.stderr,
              flush=True)
    return result


def _progress_printer():
    """A progress bar on a terminal (rich); nothing in batch logs (the two summary lines say it)."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    bar = Progress("staging", BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True)
    task = None

    def update(done: int, total: int, name: str) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task("copy", total=total)
        bar.update(task, completed=done)
        if done >= total:
            bar.stop()

    return update


def _human(n: float) -> str:
    """Staged sizes in GiB (data sets are large; train.units is above this layer)."""
    return f"{n / 2 ** 30:.2f} GiB"
