"""DeepCAM synthetic samples: an atmospheric state whose labels follow from its fields.

The channels and the storage layout are those of `data.deepcam`.

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

With ``channels < 16`` the first ``channels`` of this list are written; with
more, the extra channels are fixed random mixtures of the standardised physical
ones plus noise (handy for scaling studies).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import DataError
from .deepcam import CHANNEL_NAMES

__all__ = ["synth_deepcam_sample"]

# Label thresholds (see module docstring).
_GALE_WIND = 17.0  # m/s, tropical-storm force
_IVT_THRESHOLD = 250.0  # kg m^-1 s^-1, the usual AR detection threshold
_FILAMENT_CORE = 0.25  # cross-section weight that still counts as "inside" a filament

# Per-channel white-noise level added after labelling (same order as CHANNEL_NAMES).
_NOISE = np.array(
    [1.0, 1.0, 1.0, 1.0, 1.0, 3e-4, 60.0, 60.0, 0.4, 0.4, 1.5e-8, 0.4, 0.4, 5.0, 10.0, 0.5]
)



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
