"""CosmoFlow synthetic data: density cubes with real cosmological signal, written as HDF5.

The targets and their normalisation are `data.cosmoflow`'s; so is the reader.

Generator physics (one sample, periodic ``S^3`` grid of ``cell_size`` Mpc/h voxels):

* Linear power spectrum ``P(k) = A k^{n_s} T(k)^2`` with the BBKS transfer function
  ``T(q) = ln(1 + 2.34 q) / (2.34 q) [1 + 3.89 q + (16.1 q)^2 + (5.46 q)^3 + (6.71 q)^4]^{-1/4}``,
  ``q = k / Gamma`` (k in h/Mpc), shape parameter ``Gamma = Omega_m h``.
* ``A`` is fixed so that the top-hat variance ``sigma^2(R) = int dlnk k^3 P(k) W(kR)^2 / (2 pi^2)``
  equals ``sigma_8^2`` at ``R = 8`` Mpc/h, z = 0 (``W(x) = 3 (sin x - x cos x) / x^3``).
* Gaussian field: white noise is coloured in Fourier space by ``sqrt(P(k) W_cell(k)^2 / cell^3)``;
  for unit white noise the filtered field then has variance ``sum_k P W_cell^2 / V``, the discrete
  version of the continuum integral.  ``W_cell = prod_i sinc(k_i cell / 2)`` is the cubic-cell
  window: a voxel's particle count measures the density averaged over the voxel.  The default
  8 Mpc/h cells make the z = 0 cell rms close to sigma_8 (variance ~0.5-1.7 over the prior), so
  the log-normal tail stays far below the int16 limit.
* Channel c is the same linear field scaled by the growth factor ``D(z_c; Omega_m)`` (flat
  LCDM, Carroll-Press-Turner 1992 approximation, ``D(0) = 1``), so all redshifts share phases.
* Log-normal density ``1 + delta = exp(g - var(g) / 2)`` (Coles & Jones 1991) keeps the
  density positive; Poisson sampling with ``mean_count`` particles per voxel gives integer
  counts, like the N-body particle histograms of the real data set.

Omega_m enters through the shape (Gamma) and the growth of the high-z channels, sigma_8 through
the amplitude, n_s through the slope and H0 only through Gamma -- so H0 is the hardest target,
as in the real CosmoFlow data.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from ..errors import DataError
from .cosmoflow import (CHUNK_EDGE, PARAM_HIGH, PARAM_LOW, PARAM_NAMES, REDSHIFTS,
                        normalise_params)


def bbks_transfer(k: np.ndarray, gamma: float) -> np.ndarray:
    """BBKS (Bardeen et al. 1986) CDM transfer function for ``k`` in h/Mpc, ``T -> 1`` as ``k -> 0``."""
    q = np.maximum(k / gamma, 1e-12)  # avoid 0/0; T(0) = 1 is the limit
    poly = 1 + 3.89 * q + (16.1 * q) ** 2 + (5.46 * q) ** 3 + (6.71 * q) ** 4
    return np.log1p(2.34 * q) / (2.34 * q) * poly**-0.25


def growth_factor(z: np.ndarray | float, omega_m: float) -> np.ndarray:
    """Linear growth ``D(z) / D(0)`` in flat LCDM (Carroll, Press & Turner 1992).

    ``g(Om, OL) = 2.5 Om / (Om^{4/7} - OL + (1 + Om/2)(1 + OL/70))`` with the density parameters
    evaluated at z, and ``D(z) = g(z) / ((1 + z) g(0))``.
    """
    a3 = (1.0 + np.asarray(z, dtype=np.float64)) ** 3
    om_z = omega_m * a3 / (omega_m * a3 + 1.0 - omega_m)

    def g(om):
        ol = 1.0 - om
        return 2.5 * om / (om ** (4 / 7) - ol + (1 + om / 2) * (1 + ol / 70))

    return g(om_z) / g(omega_m) / np.cbrt(a3)


def _sigma_r_unit(n_s: float, gamma: float, radius: float = 8.0) -> float:
    """Top-hat rms ``sigma(R)`` for ``P = k^{n_s} T^2`` (amplitude 1), by trapezoid in ln k."""
    k = np.logspace(-4, 2, 1024)
    x = k * radius
    w = 3 * (np.sin(x) - x * np.cos(x)) / x**3
    integrand = k**3 * k**n_s * bbks_transfer(k, gamma) ** 2 * w**2 / (2 * np.pi**2)
    return float(np.sqrt(np.trapezoid(integrand, np.log(k))))


def _k_grid(size: int, cell_size: float) -> tuple[np.ndarray, np.ndarray]:
    """|k| in h/Mpc on the rfftn half-grid of a periodic ``size^3`` box, and ``W_cell(k)^2``."""
    kx = 2 * np.pi * np.fft.fftfreq(size, d=cell_size)
    kz = 2 * np.pi * np.fft.rfftfreq(size, d=cell_size)
    axes = (kx[:, None, None], kx[None, :, None], kz[None, None, :])
    # np.sinc(t) = sin(pi t) / (pi t), so sinc(k cell / 2) is np.sinc(k cell / (2 pi))
    w = [np.sinc(a * cell_size / (2 * np.pi)) ** 2 for a in axes]
    return np.sqrt(sum(a**2 for a in axes)), w[0] * w[1] * w[2]


def generate_sample(params, size: int, rng: np.random.Generator, *, cell_size: float = 8.0,
                    mean_count: float = 16.0, kgrid: tuple | None = None) -> np.ndarray:
    """One (size, size, size, 4) int16 particle-count cube for physical ``params`` (see module doc)."""
    omega_m, sigma_8, n_s, h0 = (float(p) for p in params)
    kmag, win2 = _k_grid(size, cell_size) if kgrid is None else kgrid
    gamma = omega_m * h0 / 100.0
    amp2 = (sigma_8 / _sigma_r_unit(n_s, gamma)) ** 2
    pk = amp2 * np.where(kmag > 0, kmag, 1.0) ** n_s * bbks_transfer(kmag, gamma) ** 2 * win2
    colour = np.sqrt(pk / cell_size**3).astype(np.float32)
    colour.flat[0] = 0.0  # no k=0 mode: the mean overdensity of the box is zero
    noise = rng.standard_normal((size,) * 3, dtype=np.float32)
    g = np.fft.irfftn(np.fft.rfftn(noise) * colour, s=noise.shape, axes=(0, 1, 2))
    d = growth_factor(np.asarray(REDSHIFTS), omega_m).astype(np.float32)
    # log-normal with the box variance per channel, so each channel's mean density is ~mean_count
    gz = g[..., None] * d
    lam = mean_count * np.exp(gz - 0.5 * float(g.var()) * d**2)
    counts = rng.poisson(lam)
    # int16 like the real data; the log-normal tail never reaches this for sensible settings
    return np.minimum(counts, np.iinfo(np.int16).max).astype(np.int16)


def write_cosmoflow(out_dir, samples: int, size: int, seed: int = 0, val_fraction: float = 0.125,
                    progress: Callable[[int, int], None] | None = None, *, cell_size: float = 8.0,
                    mean_count: float = 16.0) -> dict:
    """Write ``out_dir/train.h5`` and ``out_dir/val.h5`` (datasets ``x``, ``y``, ``params``).

    Sample ``i`` uses its own RNG stream ``SeedSequence(seed, spawn_key=(i,))``, so it is the
    same whatever ``samples`` is; the last ``round(samples * val_fraction)`` samples form ``val``.
    ``progress(done, total)`` is called after each sample.  Files are written under temporary
    names and moved into place with ``os.replace``, so an interrupted run leaves no partial file.
    """
    if samples < 1 or size < 2 or not 0.0 <= val_fraction < 1.0:
        raise DataError(f"need samples >= 1, size >= 2, 0 <= val_fraction < 1; got "
                        f"samples={samples}, size={size}, val_fraction={val_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_val = min(int(round(samples * val_fraction)), samples - 1)
    splits = {"train": (0, samples - n_val), "val": (samples - n_val, samples)}
    tmp = {name: out / f".{name}.h5.tmp-{os.getpid()}" for name in splits}
    lo, hi = np.asarray(PARAM_LOW), np.asarray(PARAM_HIGH)
    kgrid = _k_grid(size, cell_size)  # shared by all samples
    start = time.perf_counter()
    files = {}
    try:
        for name, (a, b) in splits.items():
            f = files[name] = h5py.File(tmp[name], "w")
            n = b - a
            # chunks of one sample's 16³ sub-cube (the whole sample up to 16³): a sample is read
            # without touching others, and a spatial block (a hyperslab, for spatial parallelism)
            # without reading the rest of its sample; maxshape=None lets a chunk exceed an empty split
            edge = min(size, CHUNK_EDGE)
            f.create_dataset("x", (n, size, size, size, 4), dtype="i2", chunks=(1, edge, edge, edge, 4),
                             maxshape=(None, size, size, size, 4))
            f.create_dataset("y", (n, 4), dtype="f4")
            f.create_dataset("params", (n, 4), dtype="f4")
            f.attrs.update(generator="exatrain.data.cosmoflow lognormal-BBKS-CPT v2", split=name,
                           param_names=list(PARAM_NAMES), param_low=lo, param_high=hi,
                           redshifts=np.asarray(REDSHIFTS), seed=seed, first_sample=a, size=size,
                           cell_size_mpc_h=cell_size, mean_count=mean_count,
                           target="y = 2 (params - param_low) / (param_high - param_low) - 1")
        for i in range(samples):
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,)))
            params = lo + (hi - lo) * rng.random(4)
            name = "train" if i < splits["train"][1] else "val"
            j = i - splits[name][0]
            f = files[name]
            f["x"][j] = generate_sample(params, size, rng, cell_size=cell_size,
                                        mean_count=mean_count, kgrid=kgrid)
            f["params"][j] = params
            f["y"][j] = normalise_params(params)
            if progress is not None:
                progress(i + 1, samples)
        for f in files.values():
            f.close()
        for name in splits:
            with open(tmp[name], "rb+") as fh:  # make the bytes durable before the rename
                os.fsync(fh.fileno())
            os.replace(tmp[name], out / f"{name}.h5")
    finally:
        for f in files.values():
            if f.id.valid:
                f.close()
        for p in tmp.values():
            p.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    return {"train": str(out / "train.h5"), "val": str(out / "val.h5"), "n_train": samples - n_val,
            "n_val": n_val, "size": size, "seed": seed, "seconds": seconds,
            "samples_per_s": samples / max(seconds, 1e-9)}
