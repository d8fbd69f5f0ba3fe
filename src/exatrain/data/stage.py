"""Staging: copy a data set once per node from the parallel file system to node-local storage.

MLPerf HPC's record runs staged CosmoFlow and DeepCAM into node-local storage before training and
logged it as its own phase; reading every epoch from Lustre/GPFS is the most common reason a job
waits for its input. `stage_files` copies the files a run reads (`InputFiles`, from the workload's
`input_files(config)`; all of `source` for a workload that has none) into
`DIR/exatrain-stage/<name>-<hash of the source path>/`, keeping their relative paths:

- one copier per node (the node's lowest rank); the node's other ranks wait for it, and every
  rank learns every copier's outcome, so a failure on one node stops all ranks with its message
  instead of leaving them in a collective;
- before any byte moves: `DIR` must exist, be writable and have the free bytes the copy needs;
- every copied file is checksummed (CRC-32 of the source bytes as read, then of the copy as
  written and read back) and recorded in `.exatrain-stage.json` with the source's size and
  modification time; a later run reuses a copy whose source is unchanged and whose bytes still
  have the recorded checksum, and copies again one that does not (a corrupted or partial copy);
- files are written under a temporary name and renamed, so an interrupted copy is never reused;
- with `data.shuffle = "node"` and a training set of per-sample files, node k of N copies only its
  shard of the training samples (`np.array_split` of the sample indices into N contiguous parts,
  nodes numbered by their lowest rank: the Trainer's node shard) and the validation and shared
  files; every other training sample becomes a symbolic link to its source file, so the staged
  directory lists every sample in the same order (the data set keeps its length and indices) and
  the few reads outside the shard (the workload's statistics of the first samples, its targets
  for the baseline) go to the source. A training set held in one file is copied whole.

Communication: two all-gathers of small Python objects over the world (host names; outcomes).
Bytes read from the file system: each staged file once per node (instead of once per epoch per
rank); staged bytes per node = shared files + training samples (global shuffle) or + the node's
1/N of them (node shuffle, per-sample files).
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
from typing import Callable

import numpy as np

from ..errors import MissingFileError, UserError

MANIFEST = ".exatrain-stage.json"
CHUNK = 8 << 20
STAGE_ENV = "EXATRAIN_STAGE_TO"  # a batch script's override of data.stage_to
HOST_ENV = "EXATRAIN_HOST"       # pretend host name (tests: several "nodes" on one machine)


class StagingError(UserError, RuntimeError):
    """`data.stage_to` cannot take the data set: too little free space there, or it cannot be
    written.

    What to do: free space there, use a larger node-local directory, or leave `data.stage_to`
    empty to read from `data.path`.
    """


@dataclass
class InputFiles:
    """The files a run reads, as a workload's `input_files(config)` lists them.

    `shared`: files every node reads whatever the shuffle (validation samples, statistics,
    metadata, a training set held in one file). `samples`: the training set's per-sample files in
    the data set's index order (one tuple per sample: a file, or e.g. a data and a label file);
    empty when the training set is not one file per sample."""
    shared: list[Path] = field(default_factory=list)
    samples: list[tuple[Path, ...]] = field(default_factory=list)

    def for_node(self, node: int, nodes: int, node_shard: bool) -> tuple[list[Path], list[Path]]:
        """(files node `node` of `nodes` copies, training files it links to their source)."""
        if not node_shard or not self.samples:
            return [*self.shared, *(f for sample in self.samples for f in sample)], []
        mine = set(np.array_split(np.arange(len(self.samples)), nodes)[node].tolist())
        copy = [f for i, sample in enumerate(self.samples) if i in mine for f in sample]
        link = [f for i, sample in enumerate(self.samples) if i not in mine for f in sample]
        return [*self.shared, *copy], link


@dataclass
class StageResult:
    path: Path                      # where the staged data set is (replaces data.path)
    files: int = 0
    copied_bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)  # node shard: samples read from the source
    linked_files: int = 0
    copier_rank: int | None = None   # the rank that staged this node's copy

    def figures(self) -> dict:
        return {"stage_s": self.seconds, "staged_bytes": self.copied_bytes + self.reused_bytes,
                "stage_copied_bytes": self.copied_bytes, "stage_reused_bytes": self.reused_bytes,
                "stage_files": self.files, "stage_linked_files": self.linked_files,
                "stage_copier_rank": self.copier_rank, "staged_to": str(self.path)}


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def stage_dir(source: Path, stage_to: Path, shard: tuple[int, int] | None = None) -> Path:
    """The directory of `source`'s copy under `stage_to` (one per data set path, and one per
    node shard (k, N) under the node shuffle: nodes staging into one shared directory then
    never touch each other's files)."""
    source = Path(source).resolve()
    tag = hashlib.sha1(str(source).encode()).hexdigest()[:10]
    suffix = f"-shard{shard[0]}of{shard[1]}" if shard else ""
    return Path(stage_to) / "exatrain-stage" / f"{source.name}-{tag}{suffix}"


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


SHARD_HINT = ("or set data.shuffle = \"node\" so each node stages only its shard of the "
              "training samples")


def check_stage_dir(stage_to: Path, need_bytes: int, rank: int, smaller: str = "") -> None:
    """Refuse, before copying, a stage directory that is missing, read-only or too small.
    `smaller`: how this run could stage fewer bytes, when it can (e.g. `SHARD_HINT`)."""
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
                           "Free space there" + (", use a larger node-local directory, "
                                                 f"{smaller}." if smaller else
                                                 " or use a larger node-local directory."))


def _manifest(dest: Path) -> dict:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def copy_files(files: list[Path], source: Path, dest: Path, rank: int = 0,
               progress=None, link: list[Path] = (), smaller: str = "") -> StageResult:
    """Copy `files` (under `source`) into `dest`, reusing verified copies, and make each file of
    `link` a symbolic link to its source (this process only). Afterwards the directories of the
    staged files hold exactly those files and links (a file left there by an earlier run whose
    source is gone, or a copy now linked, is removed), so a data set that lists its directory
    sees the source's samples, no more. `smaller`: for the too-small error (check_stage_dir)."""
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
               if not (same and _is_copy(target) and target.stat().st_size == stat.st_size))
    check_stage_dir(dest.parents[1], need, rank, smaller)
    dest.mkdir(parents=True, exist_ok=True)
    done = 0
    total = sum(stat.st_size for _, _, stat, _, _ in plan)
    for src, rel, stat, target, same_source in plan:
        if same_source and _is_copy(target) and target.stat().st_size == stat.st_size \
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
    for src in link:
        rel = str(Path(src).relative_to(base))
        _link(Path(src).resolve(), dest / rel)
        result.linked.append(rel)
        if manifest.pop(rel, None) is not None:
            (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    result.linked_files = len(result.linked)
    _remove_others(dest, {dest / rel for rel in (*result.copied, *result.reused, *result.linked)})
    result.seconds = time.perf_counter() - start
    return result


def _is_copy(target: Path) -> bool:
    """A staged copy (a regular file), not a link to the source."""
    return target.is_file() and not target.is_symlink()


def _link(src: Path, target: Path) -> None:
    """`target` -> `src` as a symbolic link (replacing a copy or link there, atomically)."""
    if target.is_symlink() and os.readlink(target) == str(src):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(src, tmp)
    os.replace(tmp, target)


def _remove_others(dest: Path, staged: set[Path]) -> None:
    """Remove from the directories holding `staged` every other file or link (hidden names, such
    as the manifest and other copiers' temporary files, stay)."""
    for folder in {path.parent for path in staged}:
        for entry in folder.iterdir():
            if entry not in staged and not entry.name.startswith(".") \
                    and (entry.is_symlink() or entry.is_file()):
                entry.unlink(missing_ok=True)


def stage_files(source: Path, stage_to: Path, mesh,
                files: "InputFiles | list[Path] | Callable[[], InputFiles] | None" = None,
                verbose: bool = True, node_shard: bool = False) -> StageResult:
    """Collective over the mesh's world: each node's lowest rank copies `files` (default: all of
    `source`; a callable is called on the copiers only) into node-local `stage_to`; every rank
    returns the staged path and the figures. `node_shard` (data.shuffle = "node"): each node
    copies only its shard of `files.samples` and links the rest (see the module doc)."""
    from ..comm import all_gather_object

    start = time.perf_counter()
    source = Path(source)
    if not source.exists():
        raise MissingFileError(f"data.path={source}: nothing to stage (no such file or directory).")
    hosts = all_gather_object(host_name(), mesh.world)
    me = mesh.rank
    nodes = list(dict.fromkeys(hosts))  # in order of their lowest rank, as the Trainer's shards
    copier = hosts.index(hosts[me]) == me  # the node's lowest rank
    node = nodes.index(hosts[me])
    dest = stage_dir(source, stage_to, (node, len(nodes)) if node_shard else None)
    outcome: dict = {"rank": me, "host": hosts[me]}
    result = StageResult(path=dest / source.name if source.is_file() else dest)
    if copier:
        try:
            chosen = files() if callable(files) else files
            if chosen is None:
                chosen = InputFiles(shared=data_files(source))
            elif not isinstance(chosen, InputFiles):
                chosen = InputFiles(shared=[Path(f) for f in chosen])
            copy, link = chosen.for_node(node, len(nodes), node_shard)
            smaller = SHARD_HINT if chosen.samples and not node_shard else (
                "or spread the job over more nodes (each stages 1/N of the training samples)"
                if chosen.samples else "")
            show = verbose and me == 0
            if show:
                size = sum(f.stat().st_size for f in copy)
                shard = (f" (this node's shard; {len(link)} other training files linked)"
                         if link else "")
                print(f"exatrain: staging {len(copy)} files ({_human(size)}){shard} of {source} "
                      f"to {dest} on {len(nodes)} node(s)", file=sys.stderr, flush=True)
            result = copy_files(copy, source, dest, me, _progress_printer() if show else None,
                                link=link, smaller=smaller)
            result.copier_rank = me
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
    result.files, result.copier_rank = mine["stage_files"], mine["stage_copier_rank"]
    result.linked_files = mine["stage_linked_files"]
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
    """Staged sizes in GiB, or MiB / KiB below one GiB, so that a small directory's free space
    does not read 0.00 GiB (train.units is above this layer)."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2 ** 10:.2f} KiB"
