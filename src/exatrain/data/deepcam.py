"""DeepCAM climate segmentation data: a synthetic generator and an HDF5 reader.

Storage layout (the one of the real DeepCAM / MLPerf-HPC data set)::

    out_dir/
        train/data-000000.h5  ...     one file per sample
        val/data-000175.h5    ...
        stats.h5                      climate/{mean,std,minval,maxval} per channel,
                                      climate/class_frequencies (from train)
        stats.json                    the same, human readable

Each sample file holds ``climate/data`` ``(H, W, C)`` float32 (channels last)
and ``climate/labels_0`` ``(H, W)`` integer labels
(0 = background, 1 = tropical cyclone, 2 = atmospheric river).

Synthetic fields
----------------
:func:`synth_deepcam_sample` builds a physically *related* atmospheric state so
that the labels follow from the fields and a network can learn them:

* a smooth background: zonal-mean climatology (warm moist tropics, westerly jets,
  subtropical highs) plus random low-wavenumber anomalies with winds derived
  from a streamfunction, and a fixed orography per seed;
* tropical cyclones: Holland (1980) pressure profile ``P' = -dp (1 - exp(-(Rm/r)^B))``
  with the matching cyclostrophic tangential wind (cyclonic in each hemisphere),
  a warm core aloft, extra precipitable water and heavy precipitation;
* atmospheric rivers: long curved filaments along a random smooth curve from the
  subtropics poleward, with a Gaussian cross-section of extra water vapour and an
  along-filament low-level jet.

Labels are derived from those fields, mirroring the TECA heuristics:
*tropical cyclone* where the vortex's own wind reaches gale force (17 m/s) or
inside its radius of maximum wind (the eye); *atmospheric river* where the
integrated vapour transport proxy ``IVT = TMQ * |V850|`` reaches 250 kg m^-1 s^-1
inside a filament; cyclones take precedence where both apply.

Channels (CAM5 names and units, in the real DeepCAM order)::

     0 TMQ     total precipitable water          kg m^-2
     1 U850    zonal wind at 850 hPa             m s^-1
     2 V850    meridional wind at 850 hPa        m s^-1
     3 UBOT    zonal wind, lowest level          m s^-1
     4 VBOT    meridional wind, lowest level     m s^-1
     5 QREFHT  reference-height humidity         kg kg^-1
     6 PS      surface pressure                  Pa
     7 PSL     sea-level pressure                Pa
     8 T200    temperature at 200 hPa            K
     9 T500    temperature at 500 hPa            K
    10 PRECT   total precipitation rate          m s^-1
    11 TS      surface temperature               K
    12 TREFHT  reference-height temperature      K
    13 Z1000   geopotential height of 1000 hPa   m
    14 Z200    geopotential height of 200 hPa    m
    15 ZBOT    height of the lowest level        m

With ``channels < 16`` the first ``channels`` of this list are written; with
more, the extra channels are fixed random mixtures of the standardised physical
ones plus noise (handy for scaling studies).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, MissingFileError

__all__ = [
    "CHANNEL_NAMES",
    "CLASS_NAMES",
    "synth_deepcam_sample",
    "write_deepcam",
    "load_deepcam_stats",
    "DeepCAMDataset",
    "FieldsDecoder",
]

CHANNEL_NAMES: tuple[str, ...] = (
    "TMQ", "U850", "V850", "UBOT", "VBOT", "QREFHT", "PS", "PSL",
    "T200", "T500", "PRECT", "TS", "TREFHT", "Z1000", "Z200", "ZBOT",
)  # fmt: skip
CLASS_NAMES: tuple[str, ...] = ("background", "tropical_cyclone", "atmospheric_river")

_GENERATE_HINT = "generate synthetic DeepCAM data with `exatrain data deepcam --out DIR`"

# Label thresholds (see module docstring).
_GALE_WIND = 17.0  # m/s, tropical-storm force
_IVT_THRESHOLD = 250.0  # kg m^-1 s^-1, the usual AR detection threshold
_FILAMENT_CORE = 0.25  # cross-section weight that still counts as "inside" a filament

# Per-channel white-noise level added after labelling (same order as CHANNEL_NAMES).
_NOISE = np.array(
    [1.0, 1.0, 1.0, 1.0, 1.0, 3e-4, 60.0, 60.0, 0.4, 0.4, 1.5e-8, 0.4, 0.4, 5.0, 10.0, 0.5]
)


# ------------------------------------------------------------------ generation


def _smooth_field(
    rng: np.random.Generator, h: int, w: int, kmax: int = 4, derivatives: bool = False
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Random low-wavenumber field with unit std and (optionally) its x/y derivatives.

    Built in Fourier space from wavenumbers ``<= kmax`` with a red spectrum, so
    the field is smooth at any resolution and its gradients come exactly from the
    spectrum (no finite-difference noise).  Derivatives are per unit of the field
    per *domain fraction*, i.e. resolution independent.
    """
    ky = np.fft.fftfreq(h, d=1.0 / h)[:, None]  # integer wavenumbers
    kx = np.fft.rfftfreq(w, d=1.0 / w)[None, :]
    k2 = kx**2 + ky**2
    keep = (np.abs(ky) <= kmax) & (kx <= kmax) & (k2 > 0)
    amp = np.where(keep, 1.0 / (1.0 + k2), 0.0)
    coef = amp * (rng.standard_normal(k2.shape) + 1j * rng.standard_normal(k2.shape))
    field = np.fft.irfft2(coef, s=(h, w))
    scale = field.std() or 1.0
    if not derivatives:
        return field / scale, None, None
    dfdx = np.fft.irfft2(coef * (2j * np.pi * kx), s=(h, w))
    dfdy = np.fft.irfft2(coef * (2j * np.pi * ky), s=(h, w))
    return field / scale, dfdx / scale, dfdy / scale


def _wrap_lon(d: np.ndarray | float) -> np.ndarray | float:
    """Longitude difference wrapped into [-180, 180): the grid is periodic in x."""
    return (d + 180.0) % 360.0 - 180.0


def _orography(seed: int, h: int, w: int) -> np.ndarray:
    """Surface height (m), fixed per (seed, grid) like a real model's orography."""
    rng = np.random.default_rng([seed, h, w, 0x0606])
    f, _, _ = _smooth_field(rng, h, w, kmax=6)
    return 2500.0 * np.clip(f - 0.8, 0.0, None)


def _add_cyclone(
    rng: np.random.Generator,
    lat: np.ndarray,
    lon: np.ndarray,
    lat0: float,
    lon0: float,
    fields: dict[str, np.ndarray],
    tc_mask: np.ndarray,
) -> None:
    """Add one Holland-profile vortex at (lat0, lon0) in place and mark its label."""
    rm = rng.uniform(3.0, 5.0)  # radius of maximum wind, degrees
    vmax = rng.uniform(25.0, 40.0)  # m/s
    dp = 100.0 * (vmax / 5.5) ** 2  # Pa; a common wind-pressure relation
    b = 1.5  # Holland B parameter
    dx = _wrap_lon(lon - lon0) * np.cos(np.deg2rad(lat))  # east, "degrees of great circle"
    dy = lat - lat0  # north
    r = np.maximum(np.hypot(dx, dy), 1e-3)
    x = (rm / r) ** b
    # The pure Holland profile decays only like r^-0.75 and would reach round the
    # globe; real storms merge into the ambient flow within ~10 rm, so taper the
    # outer vortex (this also keeps the field continuous across the antipode).
    outer = np.exp(-((r / (8.0 * rm)) ** 4))
    pressure = -dp * (1.0 - np.exp(-x)) * outer
    # Cyclostrophic Holland wind, peaking at vmax at r = rm.
    vt = vmax * np.sqrt(x * np.exp(1.0 - x)) * outer
    spin = 1.0 if lat0 >= 0 else -1.0  # cyclonic: anticlockwise in the north
    u, v = -spin * vt * dy / r, spin * vt * dx / r
    # Friction turns the lowest-level flow ~20 degrees towards the centre.
    ca, sa = math.cos(math.radians(20.0)), math.sin(math.radians(20.0))
    ur, vr = -dx / r * vt, -dy / r * vt  # inward component direction * speed
    fields["PSL"] += pressure
    fields["U850"] += 0.85 * u
    fields["V850"] += 0.85 * v
    fields["UBOT"] += ca * u + sa * ur
    fields["VBOT"] += ca * v + sa * vr
    fields["TMQ"] += 25.0 * np.exp(-((r / (3.0 * rm)) ** 2))
    fields["PRECT"] += 5e-7 * np.exp(-((r / (1.5 * rm)) ** 2))
    core = np.exp(-((r / (2.5 * rm)) ** 2))
    fields["T500"] += 4.0 * core  # warm core aloft
    fields["T200"] += 6.0 * core
    tc_mask |= (vt >= _GALE_WIND) | (r <= rm)


def _add_river(
    rng: np.random.Generator,
    lat: np.ndarray,
    lon: np.ndarray,
    fields: dict[str, np.ndarray],
) -> np.ndarray:
    """Add one atmospheric-river filament in place; return its cross-section weight."""
    hemi = rng.choice([-1.0, 1.0])
    sigma = rng.uniform(4.0, 6.5)  # cross-section e-folding half width, degrees
    length = rng.uniform(50.0, 90.0)
    theta0 = math.radians(rng.uniform(20.0, 45.0))  # heading, poleward of east
    wobble = math.radians(rng.uniform(10.0, 25.0))
    wavelength = rng.uniform(30.0, 60.0)
    phase = rng.uniform(0.0, 2.0 * math.pi)
    # Trace the centre line as a polyline; distances are taken to its segments,
    # so steps of about sigma already give a smooth cross-section.
    ds = sigma
    pts = [(rng.uniform(0.0, 360.0), hemi * rng.uniform(20.0, 35.0))]
    s = 0.0
    while s < length and abs(pts[-1][1]) < 65.0:
        th = theta0 + wobble * math.sin(2.0 * math.pi * s / wavelength + phase)
        lo, la = pts[-1]
        pts.append(
            (lo + ds * math.cos(th) / math.cos(math.radians(la)), la + hemi * ds * math.sin(th))
        )
        s += ds
    curve = np.array(pts)
    total = s

    # Work only on the rows/columns the filament can reach (4 sigma around the
    # curve's extent): it dominates generation time otherwise.
    margin = 4.0 * sigma
    lat_lo, lat_hi = curve[:, 1].min() - margin, curve[:, 1].max() + margin
    rows = np.nonzero((lat[:, 0] >= lat_lo) & (lat[:, 0] <= lat_hi))[0]
    lon_mid = 0.5 * (curve[:, 0].min() + curve[:, 0].max())
    half = 0.5 * (curve[:, 0].max() - curve[:, 0].min()) + margin / math.cos(
        math.radians(min(max(abs(lat_lo), abs(lat_hi)), 80.0))
    )
    cols = np.nonzero(np.abs(_wrap_lon(lon[0] - lon_mid)) <= half)[0]
    full_shape = lat.shape
    block = np.ix_(rows, cols)
    lat, lon = lat[block], lon[block]

    coslat = np.cos(np.deg2rad(lat))
    best = np.full(lat.shape, np.inf)
    along = np.zeros(lat.shape)
    tx = np.zeros(lat.shape)
    ty = np.zeros(lat.shape)
    for i in range(len(curve) - 1):
        (lo_a, la_a), (lo_b, la_b) = curve[i], curve[i + 1]
        sx = _wrap_lon(lo_b - lo_a) * coslat
        sy = la_b - la_a
        px = _wrap_lon(lon - lo_a) * coslat
        py = lat - la_a
        seg2 = sx * sx + sy * sy
        t = np.clip((px * sx + py * sy) / seg2, 0.0, 1.0)
        d = np.hypot(px - t * sx, py - t * sy)
        closer = d < best
        best = np.where(closer, d, best)
        along = np.where(closer, (i + t) * ds, along)
        norm = np.sqrt(seg2)
        tx = np.where(closer, sx / norm, tx)
        ty = np.where(closer, sy / norm, ty)
    weight = np.exp(-0.5 * (best / sigma) ** 2)
    taper = np.sqrt(np.clip(np.sin(np.pi * along / max(total, ds)), 0.0, 1.0))
    moisture = rng.uniform(18.0, 28.0)  # kg m^-2 at the core
    jet = rng.uniform(12.0, 20.0)  # m/s along the filament
    g = weight * taper
    fields["TMQ"][block] += moisture * g
    fields["U850"][block] += jet * g * tx
    fields["V850"][block] += jet * g * ty
    fields["UBOT"][block] += 0.7 * jet * g * tx
    fields["VBOT"][block] += 0.7 * jet * g * ty
    fields["PRECT"][block] += 1.5e-7 * g
    fields["TS"][block] += 1.5 * g  # warm, moist sector
    g_full = np.zeros(full_shape)
    g_full[block] = g
    return g_full


def synth_deepcam_sample(
    height: int = 96,
    width: int = 144,
    seed: int = 0,
    index: int = 0,
    channels: int = 16,
) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic DeepCAM sample.

    Deterministic in ``(seed, index, height, width, channels)``: sample ``index``
    is the same whatever the total count or split.

    Returns:
        ``data`` float32 ``(height, width, channels)`` (channels last, see
        :data:`CHANNEL_NAMES`) and ``labels`` uint8 ``(height, width)``.
    """
    if height < 2 or width < 2:
        raise DataError(f"height and width must be >= 2, got {height}x{width}")
    if channels < 1:
        raise DataError(f"channels must be >= 1, got {channels}")
    h, w = int(height), int(width)
    rng = np.random.default_rng([seed, index, h, w])
    lat1 = 90.0 - (np.arange(h) + 0.5) * 180.0 / h  # row 0 is the north
    lon1 = np.arange(w) * 360.0 / w
    lat, lon = np.meshgrid(lat1, lon1, indexing="ij")
    alat = np.abs(lat)
    s2 = np.sin(np.deg2rad(lat)) ** 2
    zs = _orography(seed, h, w)

    # --- background climatology + low-wavenumber weather
    psi, psi_x, psi_y = _smooth_field(rng, h, w, derivatives=True)
    speed = np.sqrt(np.mean(psi_x**2 + psi_y**2)) or 1.0
    # Non-divergent eddies u = -dpsi/dy, v = dpsi/dx with ~4 m/s rms; rows run
    # north -> south, so d/d(north) = -d/d(row) and u = +psi_y here.
    u_eddy, v_eddy = psi_y / speed * 4.0, psi_x / speed * 4.0
    u_zonal = 12.0 * np.exp(-(((alat - 45.0) / 12.0) ** 2)) - 6.0 * np.exp(
        -(((alat - 12.0) / 10.0) ** 2)
    )
    f = {
        "U850": u_zonal + u_eddy,
        "V850": v_eddy,
        # geostrophic balance: pressure ~ f * streamfunction (f ~ sin(lat))
        "PSL": 101_300.0
        + 1000.0 * np.exp(-(((alat - 30.0) / 10.0) ** 2))
        - 1200.0 * np.exp(-(((alat - 60.0) / 10.0) ** 2))
        + 600.0 * psi * np.sin(np.deg2rad(lat)),
        "TMQ": np.clip(
            5.0 + 45.0 * np.exp(-((lat / 25.0) ** 2)) + 4.0 * _smooth_field(rng, h, w)[0], 1.0, None
        ),
        "TS": 300.0 - 45.0 * s2 + 2.0 * _smooth_field(rng, h, w)[0] - 0.0065 * zs,
        "PRECT": np.zeros((h, w)),
        "T500": 268.0 - 25.0 * s2 + 1.5 * _smooth_field(rng, h, w)[0],
        "T200": 220.0 - 5.0 * s2 + 1.0 * _smooth_field(rng, h, w)[0],
    }
    f["UBOT"] = 0.8 * f["U850"]
    f["VBOT"] = 0.8 * f["V850"]

    # --- features
    tc_mask = np.zeros((h, w), dtype=bool)
    n_tc = int(rng.choice([1, 2, 3], p=[0.35, 0.4, 0.25]))
    centres: list[tuple[float, float]] = []
    for _ in range(20 * n_tc):  # rejection sampling keeps storms apart
        if len(centres) == n_tc:
            break
        c = (rng.choice([-1.0, 1.0]) * rng.uniform(8.0, 30.0), rng.uniform(0.0, 360.0))
        if all(abs(_wrap_lon(c[1] - o[1])) > 40.0 or abs(c[0] - o[0]) > 25.0 for o in centres):
            centres.append(c)
    for lat0, lon0 in centres:
        _add_cyclone(rng, lat, lon, lat0, lon0, f, tc_mask)
    n_ar = int(rng.choice([1, 2, 3], p=[0.35, 0.4, 0.25]))
    filament = np.zeros((h, w))
    for _ in range(n_ar):
        filament = np.maximum(filament, _add_river(rng, lat, lon, f))

    # --- derived, physically linked channels
    f["PRECT"] += 2e-8 * (f["TMQ"] / 50.0) ** 3  # moist regions drizzle
    f["PS"] = f["PSL"] * np.exp(-zs / 8400.0)
    f["QREFHT"] = f["TMQ"] / 2500.0
    f["TREFHT"] = f["TS"] - 1.5
    f["Z1000"] = (f["PSL"] - 100_000.0) / (1.2 * 9.81)
    t_mean = (f["TREFHT"] + f["T500"] + f["T200"]) / 3.0
    f["Z200"] = f["Z1000"] + 287.0 * t_mean / 9.81 * math.log(1000.0 / 200.0)
    f["ZBOT"] = 60.0 + 0.2 * (f["TREFHT"] - 288.0)

    # --- labels from the noise-free fields
    ivt = f["TMQ"] * np.hypot(f["U850"], f["V850"])
    labels = np.zeros((h, w), dtype=np.uint8)
    labels[(filament >= _FILAMENT_CORE) & (ivt >= _IVT_THRESHOLD)] = 2
    labels[tc_mask] = 1

    data = np.stack([f[name] for name in CHANNEL_NAMES], axis=-1)
    data += rng.standard_normal(data.shape, dtype=np.float32) * _NOISE
    data[..., CHANNEL_NAMES.index("PRECT")] = np.maximum(data[..., 10], 0.0)
    if channels > len(CHANNEL_NAMES):
        data = _extra_channels(data, channels, seed, rng)
    return np.ascontiguousarray(data[..., :channels], dtype=np.float32), labels


def _extra_channels(
    data: np.ndarray, channels: int, seed: int, rng: np.random.Generator
) -> np.ndarray:
    """Append ``channels - 16`` noisy mixtures of the standardised physical channels."""
    extra = channels - data.shape[-1]
    mix = np.random.default_rng([seed, 0xE7]).standard_normal((data.shape[-1], extra)) / 4.0
    z = (data - data.mean((0, 1))) / (data.std((0, 1)) + 1e-12)
    more = z @ mix + 0.1 * rng.standard_normal(z.shape[:2] + (extra,))
    return np.concatenate([data, more], axis=-1)


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


# ----------------------------------------------------------------------- reading


def load_deepcam_stats(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read normalisation statistics from a DeepCAM ``stats.h5`` or our ``stats.json``.

    Returns a dict of float64 arrays with whichever of ``mean``, ``std``,
    ``minval``, ``maxval``, ``class_frequencies`` the file has.  The real DeepCAM
    ``stats.h5`` carries ``climate/minval`` and ``climate/maxval`` (min-max
    scaling); ours carries all of them.
    """
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"DeepCAM stats file {p} does not exist; {_GENERATE_HINT}")
    keys = ("mean", "std", "minval", "maxval", "class_frequencies")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text())
            out = {k: np.asarray(raw[k], dtype=np.float64) for k in keys if k in raw}
        else:
            with h5py.File(p, "r") as fh:
                grp = fh["climate"] if "climate" in fh else fh
                out = {k: np.asarray(grp[k][...], dtype=np.float64) for k in keys if k in grp}
    except (OSError, KeyError, ValueError, TypeError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise DataError(f"cannot read DeepCAM stats file {p}: {err}") from err
    if not ({"mean", "std"} <= out.keys() or {"minval", "maxval"} <= out.keys()):
        raise DataError(f"DeepCAM stats file {p} has neither mean/std nor minval/maxval")
    return out


def sample_files(split_dir: str | os.PathLike) -> list[Path]:
    """The ``data-*.h5`` files of a split directory in the data set's index order (what
    :class:`DeepCAMDataset` reads and staging copies)."""
    split_dir = Path(split_dir)
    return [split_dir / name for name in sorted(p.name for p in split_dir.glob("data-*.h5"))]


def find_stats(split_dir: str | os.PathLike) -> Path | None:
    """The statistics file a split reads: ``stats.h5`` or ``stats.json`` in it or its parent."""
    return _find_stats(Path(split_dir))


def _find_stats(split_dir: Path) -> Path | None:
    for d in (split_dir, split_dir.parent):
        for name in ("stats.h5", "stats.json"):
            if (d / name).is_file():
                return d / name
    return None


_TORCH_LABELS = tuple(np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64,
                                             np.float32, np.float64))


class FieldsDecoder:
    """Stored DeepCAM fields -> the model's input, on whatever device the batch is: (N, H, W, C)
    as stored -> (N, C, H, W) float32, ``(x - shift) * scale`` per channel (the data set's
    normalisation, the same float32 arithmetic as its CPU path, so the values are equal to the
    last bit), written contiguous in one pass, the memory layout of the CPU path (a
    channels-last result changed the convolutions' rounding enough to move BatchNorm shifts of
    a space × tensor run past their 1e-4 bound against serial, measured).

    A batch whose last dimension is not `channels` is returned unchanged (a decoded batch, as
    `Workload.decode` must allow). A decoded batch whose width equals the channel count cannot
    be told from a raw one whose height does, and is decoded as raw: every caller hands this
    raw batches (the prefetcher, validation, predict), and taking a raw batch for a decoded one
    would train on un-normalised, transposed fields. Spatial blocks decode like whole fields."""

    def __init__(self, shift: np.ndarray | None, scale: np.ndarray | None, channels: int):
        self.channels = channels
        self.shift = None if shift is None else torch.as_tensor(shift).reshape(-1, 1, 1)
        self.scale = None if scale is None else torch.as_tensor(scale).reshape(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.channels:
            return x  # decoded (N, C, H, W), or not a batch of fields
        fields = x.permute(0, 3, 1, 2)
        out = torch.empty(fields.shape, dtype=torch.float32, device=x.device)
        if self.shift is None:
            return out.copy_(fields)
        if self.shift.device != x.device:   # once: not two host-to-device copies a batch
            self.shift, self.scale = self.shift.to(x.device), self.scale.to(x.device)
        torch.sub(fields, self.shift, out=out)
        return out.mul_(self.scale)


class DeepCAMDataset(Dataset):
    """DeepCAM split directory (``data-*.h5`` files) as a map-style torch Dataset.

    Reads both the files made by :func:`write_deepcam` and the real DeepCAM ones
    (``climate/data`` ``(H, W, C)`` float32, ``climate/labels_0`` ``(H, W)``).

    ``dataset[i]`` returns ``(x, y)``: ``x`` float32 ``(C, H, W)`` normalised per
    channel, ``y`` int64 ``(H, W)``.  With ``raw = True`` it returns what the file
    holds instead: ``x`` ``(H, W, C)`` as stored (channels last, not normalised) and
    ``y`` in its stored dtype (uint8 for ours: 1/8 of the int64 bytes); :class:`FieldsDecoder`
    then normalises whole batches on the device (the loader does no arithmetic and no
    transposing copy: 1.0 instead of 1.4 ms of CPU per 96×144×16 sample, measured).  :meth:`read` can instead fetch just a
    spatial block through an HDF5 hyperslab selection, for spatially partitioned
    training where each rank reads only its own tile.

    Files are opened per read and closed right away: with one file per sample an
    epoch touches each file once, so cached handles would buy nothing, and the
    object holds no handle, so it pickles cleanly into DataLoader workers or
    other processes.  :attr:`bytes_read` counts the raw bytes (data + labels, as
    stored) fetched by this instance; each DataLoader worker has its own copy.

    Args:
        split_dir: directory holding ``data-*.h5`` (e.g. ``out_dir/train``).
        stats: normalisation statistics: ``None`` looks for ``stats.h5`` /
            ``stats.json`` in ``split_dir`` or its parent; a path to such a
            file; a mapping with ``mean``/``std`` (z-score) or ``minval``/``maxval``
            (min-max, as MLPerf DeepCAM); or ``False`` for raw, unnormalised data.
    """

    def __init__(
        self,
        split_dir: str | os.PathLike,
        stats: str | os.PathLike | Mapping[str, Any] | bool | None = None,
    ) -> None:
        self.split_dir = Path(split_dir)
        if not self.split_dir.is_dir():
            raise MissingFileError(
                f"DeepCAM data directory {self.split_dir} does not exist; {_GENERATE_HINT}"
            )
        self.files: list[str] = [p.name for p in sample_files(self.split_dir)]
        if not self.files:
            raise MissingFileError(
                f"DeepCAM data directory {self.split_dir} holds no data-*.h5 files; "
                f"{_GENERATE_HINT}"
            )
        self.bytes_read = 0
        self.raw = False
        self.stats: dict[str, np.ndarray] = {}
        if stats is None:
            found = _find_stats(self.split_dir)
            if found is None:
                raise MissingFileError(
                    f"no stats.h5 or stats.json in {self.split_dir} or its parent; pass "
                    f"stats=... (or stats=False for raw data), or {_GENERATE_HINT}"
                )
            self.stats = load_deepcam_stats(found)
        elif stats is False:
            self.stats = {}
        elif isinstance(stats, Mapping):
            self.stats = {
                k: np.asarray(v, dtype=np.float64)
                for k, v in stats.items()
                if k in ("mean", "std", "minval", "maxval", "class_frequencies")
            }
        elif isinstance(stats, (str, os.PathLike)):
            self.stats = load_deepcam_stats(stats)
        else:
            raise TypeError(f"stats must be None, False, a path or a mapping, got {type(stats)}")
        self._shift, self._scale = self._normalisation(self.stats)

    @staticmethod
    def _normalisation(stats: Mapping[str, np.ndarray]) -> tuple[np.ndarray | None, ...]:
        """(shift, scale) so that ``x_norm = (x - shift) * scale`` per channel."""
        if "mean" in stats and "std" in stats:
            shift, spread = stats["mean"], stats["std"]
        elif "minval" in stats and "maxval" in stats:
            shift, spread = stats["minval"], stats["maxval"] - stats["minval"]
        elif not stats or set(stats) <= {"class_frequencies"}:
            return None, None
        else:
            raise DataError(f"stats need mean/std or minval/maxval, got keys {sorted(stats)}")
        # A constant channel would divide by zero; leave it merely centred.
        spread = np.where(np.asarray(spread) > 0, spread, 1.0)
        return (
            np.asarray(shift, dtype=np.float32).reshape(-1, 1, 1),
            (1.0 / np.asarray(spread, dtype=np.float64)).astype(np.float32).reshape(-1, 1, 1),
        )

    @property
    def normalisation(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(shift, scale) per channel, ``x_norm = (x - shift) * scale``; (None, None) for raw data."""
        return self._shift, self._scale

    @property
    def class_frequencies(self) -> np.ndarray | None:
        """Training class frequencies from the stats file, if it has them."""
        return self.stats.get("class_frequencies")

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> Path:
        """Path of sample ``index``."""
        return self.split_dir / self.files[index]

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the first sample, from metadata only (no data read)."""
        path = self.path(0)
        with self._open(path) as fh:
            data, _ = self._datasets(fh, path)
            h, w, c = data.shape
        return c, h, w

    @staticmethod
    def _open(path: Path) -> h5py.File:
        try:
            return h5py.File(path, "r")
        except FileNotFoundError:
            raise
        except OSError as err:
            raise DataError(f"cannot open DeepCAM sample {path}: {err}") from err

    def _datasets(self, fh: h5py.File, path: Path) -> tuple[h5py.Dataset, h5py.Dataset]:
        """The data/label datasets of an open file, shape-checked."""
        try:
            data, labels = fh["climate/data"], fh["climate/labels_0"]
        except KeyError as err:
            raise DataError(
                f"DeepCAM sample {path} lacks climate/data or climate/labels_0"
            ) from err
        if data.ndim != 3 or labels.ndim != 2 or data.shape[:2] != labels.shape:
            raise DataError(
                f"DeepCAM sample {path} has climate/data {data.shape} and climate/labels_0 "
                f"{labels.shape}; expected (H, W, C) and (H, W)"
            )
        if self._shift is not None and data.shape[2] != self._shift.shape[0]:
            raise DataError(
                f"DeepCAM sample {path} has {data.shape[2]} channels but the stats have "
                f"{self._shift.shape[0]}"
            )
        return data, labels

    def read(
        self, index: int, region: tuple[slice, slice] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read sample ``index``, optionally only the block ``region = (rows, cols)``.

        ``region`` is a pair of slices over ``(H, W)``; only that hyperslab is read
        from the file, so the result equals ``read(index)`` sliced the same way
        while touching a fraction of the bytes.

        Returns:
            ``x`` float32 ``(C, h, w)`` normalised, ``y`` int64 ``(h, w)``.
        """
        if region is not None:
            if (
                not isinstance(region, tuple)
                or len(region) != 2
                or not all(isinstance(s, slice) for s in region)
            ):
                raise TypeError(f"region must be a tuple of two slices, got {region!r}")
            if any(s.step not in (None, 1) for s in region):
                raise ValueError(f"region slices must be contiguous (step 1), got {region!r}")
        path = self.path(index)
        with self._open(path) as fh:
            data_ds, label_ds = self._datasets(fh, path)
            try:
                if region is None:
                    raw, lab = data_ds[...], label_ds[...]
                else:
                    rows, cols = region
                    raw, lab = data_ds[rows, cols, :], label_ds[rows, cols]
            except (OSError, ValueError, TypeError) as err:
                raise DataError(f"cannot read DeepCAM sample {path}: {err}") from err
        self.bytes_read += raw.nbytes + lab.nbytes
        if self.raw:  # as stored; torch lacks uint16/uint32 arithmetic: widen those labels
            lab = lab if lab.dtype in _TORCH_LABELS else lab.astype(np.int64)
            return torch.from_numpy(raw), torch.from_numpy(lab)
        x = np.ascontiguousarray(np.moveaxis(raw, -1, 0), dtype=np.float32)
        if self._shift is not None:
            x -= self._shift
            x *= self._scale
        return torch.from_numpy(x), torch.from_numpy(lab.astype(np.int64))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full sample ``index`` as ``(x, y)``."""
        return self.read(index)
