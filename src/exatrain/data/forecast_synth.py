"""Forecasting data from a real 2D simulation: the rotating shallow-water equations, solved
and written (`write_forecast`) for `data.forecast`'s reader.

The generator integrates the nonlinear rotating shallow-water equations on a doubly
periodic f-plane in vector-invariant form,

    dh/dt + div(h u)                  = -nu4 lap(lap(h))
    du/dt - q (h v) + d/dx (g h + K)  = -nu4 lap(lap(u))
    dv/dt + q (h u) + d/dy (g h + K)  = -nu4 lap(lap(v))

with u = (u, v) the velocity, h the fluid depth, g gravity, f the (constant) Coriolis
parameter, K = (u^2 + v^2) / 2 the kinetic energy per unit mass and
q = (f + zeta) / h the potential vorticity, zeta = dv/dx - du/dy. The biharmonic
term (hyperdiffusion, coefficient nu4 > 0) removes grid-scale noise (enstrophy
cascading to the grid) while leaving the resolved scales essentially inviscid.

Discretisation: an Arakawa C-grid (h at cell centres, u on west faces, v on south
faces, zeta and q on corners) with Sadourny's (1975) energy-conserving averaging of
the Coriolis/vorticity term, and the SSP-RK3 (Shu-Osher) time stepper with the
hyperdiffusion split off into one forward-Euler substep per step. Because the
continuity equation is discretised in flux form, sum(h) is conserved to round-off
on the periodic grid (the hyperdiffusion of h is a divergence too, so it conserves
mass as well). The time step obeys a CFL bound on the gravity-wave speed plus the
flow speed, and is snapped so that an integer number of steps fills ``dt_save``.

Initial conditions (random per trajectory): a geostrophically balanced double jet
(periodic in y, so it comes as a pair of opposite jets), meandering in x so that it
goes barotropically unstable, plus a few unbalanced Gaussian height bumps that
radiate inertia-gravity waves during geostrophic adjustment.

Saved fields are (h, u, v) on cell centres (u, v averaged from their faces), in
float32, as ``fields`` of shape (N_traj, T, 3, H, W) in ``train.h5`` / ``val.h5``.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..errors import DataError
from .forecast import CHANNELS, EQUATION


# ----------------------------------------------------------------------------------
# The solver. Arrays are (B, ny, nx): B independent trajectories integrated at once
# (vectorised), index [.., j, i] with j along y and i along x.
#   h[j, i] at ((i + 1/2) dx, (j + 1/2) dy)   cell centre
#   u[j, i] at ( i        dx, (j + 1/2) dy)   west face
#   v[j, i] at ((i + 1/2) dx,  j        dy)   south face
#   q[j, i] at ( i        dx,  j        dy)   south-west corner
# ----------------------------------------------------------------------------------


def _xm(a: np.ndarray) -> np.ndarray:
    """a[j, i-1] (periodic)."""
    return np.roll(a, 1, axis=-1)


def _xp(a: np.ndarray) -> np.ndarray:
    """a[j, i+1] (periodic)."""
    return np.roll(a, -1, axis=-1)


def _ym(a: np.ndarray) -> np.ndarray:
    """a[j-1, i] (periodic)."""
    return np.roll(a, 1, axis=-2)


def _yp(a: np.ndarray) -> np.ndarray:
    """a[j+1, i] (periodic)."""
    return np.roll(a, -1, axis=-2)


def _lap(a: np.ndarray, dx: float, dy: float) -> np.ndarray:
    """5-point Laplacian, periodic; on any of the C-grid's staggered grids."""
    return (_xp(a) - 2 * a + _xm(a)) / dx**2 + (_yp(a) - 2 * a + _ym(a)) / dy**2


class _ShallowWater:
    """Inviscid right-hand side and time step of the C-grid rotating shallow-water model."""

    def __init__(self, dx: float, dy: float, g: float, f: float, nu4: float) -> None:
        self.dx, self.dy, self.g, self.f, self.nu4 = dx, dy, g, f, nu4

    def rhs(
        self, h: np.ndarray, u: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Inviscid tendencies (dh/dt, du/dt, dv/dt) on the C-grid:

            dh/dt = -(delta_x U + delta_y V),     U = avg_x(h) u,  V = avg_y(h) v
            du/dt =  avg_y(q avg_x(V)) - delta_x B,   B = g h + (avg_x(u^2) + avg_y(v^2))/2
            dv/dt = -avg_x(q avg_y(U)) - delta_y B,   q = (f + delta_x v - delta_y u) / avg_xy(h)

        This conserves mass exactly and the energy
        sum(g h^2 / 2 + (avg_x(h) u^2 + avg_y(h) v^2) / 2) in the semi-discrete sense
        (the q-terms cancel in pairs; delta_x B sums by parts against delta_x U).
        """
        dx, dy, g, f = self.dx, self.dy, self.g, self.f
        # Mass fluxes on faces: U = h^x u, V = h^y v (h averaged onto the face).
        U = 0.5 * (h + _xm(h)) * u
        V = 0.5 * (h + _ym(h)) * v
        # Flux-form continuity: telescopes to zero in the domain sum -> exact mass
        # conservation up to round-off.
        dh = -((_xp(U) - U) / dx + (_yp(V) - V) / dy)
        # Relative vorticity and potential vorticity on corners.
        zeta = (v - _xm(v)) / dx - (u - _ym(u)) / dy
        h_corner = 0.25 * (h + _xm(h) + _ym(h) + _xm(_ym(h)))
        q = (f + zeta) / h_corner
        # Bernoulli function at centres: g h + K, K from face velocities averaged.
        B = g * h + 0.25 * (u**2 + _xp(u) ** 2 + v**2 + _yp(v) ** 2)
        # Sadourny energy-conserving form: average q*V (resp. q*U) onto u (resp. v).
        qV = q * 0.5 * (V + _xm(V))  # V at corners, times q, on corners
        qU = q * 0.5 * (U + _ym(U))  # U at corners, times q, on corners
        du = 0.5 * (qV + _yp(qV)) - (B - _xm(B)) / dx
        dv = -0.5 * (qU + _xp(qU)) - (B - _ym(B)) / dy
        return dh, du, dv

    def step(
        self, h: np.ndarray, u: np.ndarray, v: np.ndarray, dt: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One time step: SSP-RK3 (Shu-Osher) on the inviscid terms F,
            y1 = y + dt F(y);  y2 = 3/4 y + 1/4 (y1 + dt F(y1));
            y* = 1/3 y + 2/3 (y2 + dt F(y2)),
        then the hyperdiffusion as a split forward-Euler step y' = y* - dt nu4 lap^2 y*.
        Splitting it out costs one biharmonic per step instead of three (half the
        solver's time); it is first-order in time but only acts on grid-scale
        noise, and it is stable since dt * 64 nu4 / dx^4 = dt * rate << 2.
        On h it is a discrete divergence, so mass stays conserved to round-off.
        """
        a = self.rhs(h, u, v)
        h1, u1, v1 = h + dt * a[0], u + dt * a[1], v + dt * a[2]
        a = self.rhs(h1, u1, v1)
        h2 = 0.75 * h + 0.25 * (h1 + dt * a[0])
        u2 = 0.75 * u + 0.25 * (u1 + dt * a[1])
        v2 = 0.75 * v + 0.25 * (v1 + dt * a[2])
        a = self.rhs(h2, u2, v2)
        h = h / 3 + 2 / 3 * (h2 + dt * a[0])
        u = u / 3 + 2 / 3 * (u2 + dt * a[1])
        v = v / 3 + 2 / 3 * (v2 + dt * a[2])
        if self.nu4 > 0:
            k = dt * self.nu4
            h = h - k * _lap(_lap(h, self.dx, self.dy), self.dx, self.dy)
            u = u - k * _lap(_lap(u, self.dx, self.dy), self.dx, self.dy)
            v = v - k * _lap(_lap(v, self.dx, self.dy), self.dx, self.dy)
        return h, u, v


def _periodic_dist(a: np.ndarray, a0: float, period: float) -> np.ndarray:
    """Signed shortest distance a - a0 on a circle of length ``period``."""
    d = (a - a0) % period
    return np.where(d > period / 2, d - period, d)


def _initial_state(
    rng: np.random.Generator, ny: int, nx: int, Lx: float, Ly: float, g: float, f: float, H0: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One random initial condition (h, u, v) on the C-grid.

    Balanced part: a surface elevation eta_b(x, y) turned into the geostrophic
    streamfunction psi = g eta_b / f, sampled on corners, with u = -d psi/dy and
    v = d psi/dx by C-grid differences (so the balanced flow is exactly
    non-divergent). eta_b is a double jet
        eta_b = a tanh(s sin(2 pi (y - y0(x)) / Ly)) / tanh(s),
    y0(x) = y0 + e sin(2 pi k x / Lx + phi): the meander seeds barotropic instability.
    Unbalanced part: 2-4 Gaussian bumps of amplitude +-A, width w, added to h only.
    """
    dx, dy = Lx / nx, Ly / ny
    xc = (np.arange(nx) + 0.5) * dx
    yc = (np.arange(ny) + 0.5) * dy
    xq = np.arange(nx) * dx
    yq = np.arange(ny) * dy

    amp = rng.uniform(0.04, 0.08) * H0
    sharp = rng.uniform(1.2, 2.0)
    y0 = rng.uniform(0, Ly)
    meander = rng.uniform(0.02, 0.06) * Ly
    k = int(rng.integers(1, 4))
    phase = rng.uniform(0, 2 * np.pi)
    sign = rng.choice([-1.0, 1.0])

    def eta_bal(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        yy = y[:, None] - y0 - meander * np.sin(2 * np.pi * k * x[None, :] / Lx + phase)
        return sign * amp * np.tanh(sharp * np.sin(2 * np.pi * yy / Ly)) / np.tanh(sharp)

    psi = g * eta_bal(xq, yq) / f  # on corners
    u = -(np.roll(psi, -1, axis=0) - psi) / dy  # corner j+1 minus corner j -> face (j+1/2)
    v = (np.roll(psi, -1, axis=1) - psi) / dx
    h = H0 + eta_bal(xc, yc)
    for _ in range(int(rng.integers(2, 5))):
        A = rng.uniform(0.05, 0.12) * H0 * rng.choice([-1.0, 1.0])
        w = rng.uniform(0.04, 0.08) * Ly
        ddx = _periodic_dist(xc, rng.uniform(0, Lx), Lx)
        ddy = _periodic_dist(yc, rng.uniform(0, Ly), Ly)
        h = h + A * np.exp(-(ddy[:, None] ** 2 + ddx[None, :] ** 2) / (2 * w**2))
    return h, u, v


def simulate_shallow_water(
    trajectories: int,
    steps: int,
    height: int = 64,
    width: int = 128,
    dt_save: float = 0.05,
    seed: int = 0,
    *,
    g: float = 1.0,
    f: float = 10.0,
    H0: float = 1.0,
    Ly: float = 1.0,
    cfl: float = 0.4,
    hyperdiffusion_rate: float = 20.0,
    spinup: float = 0.0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Integrate ``trajectories`` random shallow-water runs; return fields and parameters.

    Returns ``fields`` of shape (trajectories, steps, 3, height, width), float64,
    channels (h, u, v) on cell centres, sampled every ``dt_save`` model time units
    starting after ``spinup``; and a dict of the physical/numerical parameters.

    Units are non-dimensional: g = H0 = 1 gives gravity-wave speed c = sqrt(g H0) = 1;
    the domain is Ly x Lx with Lx = Ly * width / height (square cells, dx = dy); the
    Rossby deformation radius is L_d = c / f (0.1 Ly by default, well resolved).
    Time step: dt <= cfl * dx / (c_max + |u|_max), computed from the initial states
    with a margin, then reduced so that dt_save / dt is an integer. Hyperdiffusion:
    nu4 = hyperdiffusion_rate * dx^4 / 64, i.e. the 2-grid-point checkerboard mode
    (biharmonic eigenvalue 64 / dx^4) is damped at ``hyperdiffusion_rate`` per unit time.
    """
    if trajectories < 1 or steps < 1:
        raise DataError(f"need trajectories >= 1 and steps >= 1, got {trajectories}, {steps}")
    if height < 4 or width < 4:
        raise DataError(f"grid too small: {height} x {width}")
    if dt_save <= 0:
        raise DataError(f"dt_save must be > 0, got {dt_save}")
    Lx = Ly * width / height
    dx, dy = Lx / width, Ly / height
    nu4 = hyperdiffusion_rate * min(dx, dy) ** 4 / 64.0

    states = [
        _initial_state(np.random.default_rng([seed, n]), height, width, Lx, Ly, g, f, H0)
        for n in range(trajectories)
    ]
    h = np.stack([s[0] for s in states])
    u = np.stack([s[1] for s in states])
    v = np.stack([s[2] for s in states])

    # Wave speed + flow speed, with a 1.5x margin on the flow: the jets and the
    # adjusting bumps can accelerate the flow somewhat after t = 0.
    speed = math.sqrt(g * float(h.max())) + 1.5 * float(max(np.abs(u).max(), np.abs(v).max()))
    dt_cfl = cfl * min(dx, dy) / speed
    if hyperdiffusion_rate > 0:
        # The split forward-Euler hyperdiffusion step needs dt * rate < 2; keep it < 1.
        dt_cfl = min(dt_cfl, 1.0 / hyperdiffusion_rate)
    n_sub = max(1, math.ceil(dt_save / dt_cfl))
    dt = dt_save / n_sub
    model = _ShallowWater(dx, dy, g, f, nu4)

    for _ in range(int(round(spinup / dt))):
        h, u, v = model.step(h, u, v, dt)

    out = np.empty((trajectories, steps, 3, height, width), dtype=np.float64)
    for t in range(steps):
        if t > 0:
            for _ in range(n_sub):
                h, u, v = model.step(h, u, v, dt)
        out[:, t, 0] = h
        out[:, t, 1] = 0.5 * (u + _xp(u))  # west + east face -> centre
        out[:, t, 2] = 0.5 * (v + _yp(v))  # south + north face -> centre
    if not np.isfinite(out).all():
        raise DataError(
            "shallow-water simulation blew up (non-finite values); lower cfl"
        )
    params = {
        "g": g,
        "f": f,
        "H0": H0,
        "Lx": Lx,
        "Ly": Ly,
        "dx": dx,
        "dy": dy,
        "nu4": nu4,
        "hyperdiffusion_rate": hyperdiffusion_rate,
        "cfl": cfl,
        "dt": dt,
        "dt_save": dt_save,
        "substeps_per_save": n_sub,
        "spinup": spinup,
        "deformation_radius": math.sqrt(g * H0) / f,
        "seed": seed,
    }
    return out, params


# ----------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------


def _write_h5_atomic(path: Path, fields: np.ndarray, attrs: dict[str, Any]) -> None:
    """Write ``fields`` + attrs to a temp file in the same directory, then os.replace:
    readers never see a half-written file, and a crash leaves the old file intact."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as fh:
            # One chunk per snapshot: ForecastDataset reads single (C, H, W) frames.
            fh.create_dataset(
                "fields", data=fields.astype(np.float32), chunks=(1, 1) + fields.shape[2:]
            )
            for key, value in attrs.items():
                fh.attrs[key] = value
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_forecast(
    out_dir: str | os.PathLike[str],
    trajectories: int,
    steps: int,
    height: int = 64,
    width: int = 128,
    dt_save: float = 0.05,
    seed: int = 0,
    val_fraction: float = 0.125,
    **sim_kwargs: Any,
) -> dict[str, Any]:
    """Simulate shallow-water trajectories and write ``train.h5`` / ``val.h5``.

    Trajectories are split (not time steps, so validation is on unseen initial
    conditions): n_val = max(1, round(val_fraction * trajectories)) when
    trajectories >= 2 and val_fraction > 0, the last ones go to val.
    Each file holds ``fields`` (N, T, 3, H, W) float32 and attrs: ``equation``,
    ``channels``, ``dt`` (solver step), ``dt_save``, the physical parameters, and
    ``mean`` / ``std`` per channel computed over the *train* split (both files
    carry the train statistics, so val is normalised the same way).
    Extra keyword arguments go to :func:`simulate_shallow_water`.

    Returns a summary dict: paths, counts, shape, mean, std, params, seconds.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fields, params = simulate_shallow_water(
        trajectories, steps, height, width, dt_save, seed, **sim_kwargs
    )
    seconds = time.perf_counter() - t0

    n_val = 0
    if trajectories >= 2 and val_fraction > 0:
        n_val = min(trajectories - 1, max(1, round(val_fraction * trajectories)))
    train, val = fields[: trajectories - n_val], fields[trajectories - n_val :]
    mean = train.mean(axis=(0, 1, 3, 4))
    std = train.std(axis=(0, 1, 3, 4))
    # A channel can be constant (e.g. steps=1 with no flow); avoid dividing by zero.
    std = np.where(std > 0, std, 1.0)

    attrs: dict[str, Any] = {
        "equation": EQUATION,
        "channels": np.array(CHANNELS, dtype=h5py.string_dtype()),
        "mean": mean.astype(np.float64),
        "std": std.astype(np.float64),
        "grid": "Arakawa C-grid, saved on cell centres (u, v face-averaged)",
        "scheme": "SSP-RK3, Sadourny energy-conserving vorticity flux, biharmonic hyperdiffusion",
    }
    attrs.update(params)
    train_path, val_path = out / "train.h5", out / "val.h5"
    _write_h5_atomic(train_path, train, {**attrs, "split": "train"})
    _write_h5_atomic(val_path, val, {**attrs, "split": "val"})
    return {
        "train": str(train_path),
        "val": str(val_path),
        "n_train": int(train.shape[0]),
        "n_val": int(val.shape[0]),
        "shape": tuple(int(s) for s in fields.shape),
        "channels": list(CHANNELS),
        "mean": mean.tolist(),
        "std": std.tolist(),
        "params": params,
        "seconds": seconds,
    }
