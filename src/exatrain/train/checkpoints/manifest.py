"""Checkpoint manifests: what a checkpoint is, and proof that its files are the ones written.

`manifest.json` (JSON, never pickle) sits in every checkpoint folder:

    {"format": 1, "step", "plan", "world_size", "config_sha256", "exatrain", "torch",
     "files":   {name: {"bytes", "sha256"}},           every file but the manifest itself
     "tensors": {"model.<fqn>": {"shape", "dtype", "crc32": {"<offsets>": crc}}, ...}}

`tensors` holds one CRC-32 per saved chunk (the chunk each rank wrote, keyed by its offsets in the
full tensor), gathered to rank 0 at save time; `files` holds a SHA-256 per file. `verify` checks
every file's size and hash before anything of the checkpoint is read -- in particular before DCP
unpickles its `.metadata` -- so a truncated or altered checkpoint is refused by name, never half
loaded. The per-tensor CRCs let a reader (`exatrain export`) check each tensor it reassembles.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import torch

from ...comm.dtensor import is_dtensor

MANIFEST = "manifest.json"
FORMAT = 1


def config_hash(config: dict | None) -> str:
    if config is None:
        return ""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensor_crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (contiguous, on the CPU)."""
    data = tensor.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return zlib.crc32(data.numpy().tobytes())


def local_chunks(state: dict, prefix: str) -> dict:
    """{key: {"shape", "dtype", "crc32": {offsets: crc}}} of the chunks this rank holds; a
    DTensor's chunk is keyed by its offsets in the full tensor, a plain tensor by "0,..."."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for key, value in _flatten(state, prefix):
        if not isinstance(value, torch.Tensor):
            continue
        if is_dtensor(value):
            _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                               value.placements)
            local = value.to_local()
        else:
            offsets, local = (0,) * value.dim(), value
        out[key] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                    "crc32": {",".join(map(str, offsets)): tensor_crc(local)}}
    return out


def _flatten(state, prefix: str):
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _flatten(value, f"{prefix}.{i}")
    else:
        yield prefix, state


def merge_chunks(per_rank: list[dict]) -> dict:
    """Rank-wise `local_chunks` merged: one entry per tensor with every distinct chunk's CRC."""
    merged: dict = {}
    for chunks in per_rank:
        for key, entry in chunks.items():
            merged.setdefault(key, {**entry, "crc32": {}})["crc32"].update(entry["crc32"])
    return merged


def write(folder: Path, info: dict, tensors: dict) -> dict:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": FORMAT, **info, "exatrain": _version(), "torch": torch.__version__,
                "files": files, "tensors": tensors}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify(folder: Path, error=ValueError) -> dict:
    """The manifest of `folder` after checking every file against it; raises `error` naming the
    first file that is missing, truncated or altered."""
    path = folder / MANIFEST
    if not path.is_file():
        raise error(f"{folder}: no {MANIFEST}; a checkpoint without a manifest cannot be verified "
                    "(written before manifests existed, or its write never finished).")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as exc:
        raise error(f"{path} is damaged ({exc}); the checkpoint cannot be verified.") from None
    for name, expected in files.items():
        file = folder / name
        if not file.is_file():
            raise error(f"checkpoint {folder}: file {name} listed in its manifest is missing.")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise error(f"checkpoint {folder}: file {name} has {size} bytes, its manifest says "
                        f"{expected['bytes']} (truncated or overwritten); refusing to load it. "
                        "An earlier checkpoint in the same folder may be intact.")
        if _sha256(file) != expected["sha256"]:
            raise error(f"checkpoint {folder}: file {name} does not match the SHA-256 in its "
                        "manifest (altered or corrupted on disk); refusing to load it. An earlier "
                        "checkpoint in the same folder may be intact.")
    return manifest


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("exatrain")
    except Exception:
        return "unknown"
