"""Writing a synthetic DeepCAM data set (`exatrain data deepcam`) in the layout `data.deepcam`
reads: one file per sample, written atomically by parallel workers, and the training split's
per-channel statistics and class frequencies (stats.h5, stats.json).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..errors import DataError
from .deepcam import CHANNEL_NAMES, CLASS_NAMES
from .deepcam_synth import synth_deepcam_sample

__all__ = ["write_deepcam"]


def _write_atomic_h5(path: Path, data: np.ndarray, labels: np.ndarray) -> None:
    """Write one sample under a temporary name, then rename it into place, so a
    reader (or a crash) never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as fh:
            grp = fh.create_group("climate")
            grp.create_dataset("data", data=data)
            grp.create_dataset("labels_0", data=labels)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_sample(job) -> tuple[str, tuple | None]:
    """Generate and write one sample; its moments when it is a training sample."""
    directory, height, width, channels, seed, index, train = job
    data, labels = synth_deepcam_sample(height, width, seed=seed, index=index, channels=channels)
    name = f"data-{index:06d}.h5"
    _write_atomic_h5(directory / name, data, labels)
    if not train:
        return name, None
    flat = data.reshape(-1, channels).astype(np.float64)
    return name, (flat.sum(0), (flat * flat).sum(0), flat.min(0), flat.max(0),
                  np.bincount(labels.ravel(), minlength=len(CLASS_NAMES)))


def write_deepcam(
    out_dir: str | os.PathLike,
    samples: int,
    height: int = 96,
    width: int = 144,
    channels: int = 16,
    seed: int = 0,
    val_fraction: float = 0.125,
    workers: int = 0,
) -> dict[str, Any]:
    """Generate a synthetic DeepCAM data set in the real DeepCAM HDF5 layout.

    ``workers`` processes generate samples side by side (0: up to 8, one per core; a
    768 × 1152 sample takes about 9 s of one core); the files and statistics do not depend
    on it.

    Samples ``0 .. n_train-1`` go to ``out_dir/train``, the rest to
    ``out_dir/val`` with ``n_val = round(samples * val_fraction)`` (at least one
    of each when ``samples >= 2`` and ``0 < val_fraction < 1``).  Per-channel
    mean/std/min/max and class frequencies are computed from the training split
    and written to ``stats.h5`` and ``stats.json``.  Every file is written
    atomically; ``data-*.h5`` files left in ``train``/``val`` by an earlier, larger
    run are removed so the directories hold exactly this data set.

    Returns:
        A summary dict: paths, counts, shape, channel names, ``mean``, ``std``,
        ``class_frequencies`` and generation ``seconds``.
    """
    if samples < 1:
        raise DataError(f"samples must be >= 1, got {samples}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    start = time.perf_counter()
    out = Path(out_dir)
    n_val = int(round(samples * val_fraction))
    if samples >= 2 and val_fraction > 0:
        n_val = min(max(n_val, 1), samples - 1)
    n_train = samples - n_val
    dirs = {"train": out / "train", "val": out / "val"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)

    names = list(CHANNEL_NAMES[:channels]) + [
        f"EXTRA{i}" for i in range(len(CHANNEL_NAMES), channels)
    ]
    total = np.zeros(channels)
    total_sq = np.zeros(channels)
    vmin = np.full(channels, np.inf)
    vmax = np.full(channels, -np.inf)
    counts = np.zeros(len(CLASS_NAMES), dtype=np.int64)
    written: dict[str, set[str]] = {"train": set(), "val": set()}
    jobs = [(i, "train" if i < n_train else "val") for i in range(samples)]
    args = [(dirs[split], height, width, channels, seed, i, split == "train") for i, split in jobs]
    workers = workers or min(8, os.cpu_count() or 1, samples)
    if workers > 1:  # samples are independent (seed, index): one process each, files in order
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_write_sample, args))
    else:
        results = [_write_sample(a) for a in args]
    for (i, split), (name, moments) in zip(jobs, results):
        written[split].add(name)
        if moments is not None:  # the training split's per-channel moments and class counts
            s1, s2, lo, hi, classes = moments
            total += s1
            total_sq += s2
            vmin = np.minimum(vmin, lo)
            vmax = np.maximum(vmax, hi)
            counts += classes
    for split, d in dirs.items():
        for stale in d.glob("data-*.h5"):
            if stale.name not in written[split]:
                stale.unlink()

    npix = n_train * height * width
    mean = total / npix
    std = np.sqrt(np.maximum(total_sq / npix - mean**2, 0.0))
    freqs = counts / counts.sum()
    stats = {
        "channels": names,
        "classes": list(CLASS_NAMES),
        "mean": mean.tolist(),
        "std": std.tolist(),
        "minval": vmin.tolist(),
        "maxval": vmax.tolist(),
        "class_frequencies": freqs.tolist(),
        "height": height,
        "width": width,
        "train_samples": n_train,
        "val_samples": n_val,
        "seed": seed,
    }
    tmp = out / f".stats.h5.tmp{os.getpid()}"
    with h5py.File(tmp, "w") as fh:
        grp = fh.create_group("climate")
        for key in ("mean", "std", "minval", "maxval", "class_frequencies"):
            grp.create_dataset(key, data=np.asarray(stats[key], dtype=np.float64))
        grp.attrs["channels"] = json.dumps(names)
    os.replace(tmp, out / "stats.h5")
    tmp = out / f".stats.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(stats, indent=2))
    os.replace(tmp, out / "stats.json")

    return {
        "out_dir": str(out),
        "train_dir": str(dirs["train"]),
        "val_dir": str(dirs["val"]),
        "stats_file": str(out / "stats.h5"),
        "train_samples": n_train,
        "val_samples": n_val,
        "shape": (height, width, channels),
        "channel_names": names,
        "mean": stats["mean"],
        "std": stats["std"],
        "class_frequencies": stats["class_frequencies"],
        "seconds": time.perf_counter() - start,
    }
