"""Structures, energies and forces of adsorbates on metal surfaces, relaxed with a real
interatomic potential: the S2EF task of MLPerf HPC's OpenCatalyst benchmark (OC20), at a size a
CPU writes in seconds.

OC20's S2EF ("structure to energy and forces") frames are the steps of DFT relaxations of an
adsorbate on a catalyst surface, the lower layers held fixed. This writer makes frames the same
way with ASE's Effective Medium Theory potential (EMT, Jacobsen, Stoltze and Nørskov, Surf. Sci.
366, 394 (1996)) in place of DFT: for each system a metal (Al, Ni, Cu, Pd, Ag, Pt, Au), a
three-by-three fcc(111) patch two layers deep (18 atoms, its lower layer fixed), an adsorbate
(O, H, N, C, OH, CO, NO, CH, NH) on an fcc, hcp, top or bridge site, every free atom displaced
at random (`rattle` Å), then a BFGS relaxation whose first `frames` steps are the system's
frames. Each frame's energy and forces are EMT's at its stored (float32) positions.

What differs from OC20: EMT instead of DFT (EMT's C, N, O and H parameters are rough, so the
adsorbate chemistry is not quantitative; the metals are EMT's strength); a finite patch instead
of a periodic slab (no periodic images: the model sees a cluster); 18–20 atoms instead of OC20's
~70; hundreds of frames instead of two million.

File: DIR/catalysis.h5 (`write_catalysis`, `exatrain data catalysis --out DIR`):

    z        (N, 20) uint8    atomic numbers, zero-padded
    pos      (N, 20, 3) f32   positions in Å
    forces   (N, 20, 3) f32   EMT forces in eV/Å, every atom's (the fixed ones' too)
    free     (N, 20) bool     the atoms a relaxation moves (OC20's train_on_free_atoms)
    energy   (N,) f64         EMT potential energy in eV
    system   (N,) int32       the relaxation a frame belongs to (splits never share one)

`CatalysisDataset` serves (atoms, target): atoms (20, 4) rows [Z, x, y, z] as QM9's, target
(20, 4) rows [Fx, Fy, Fz, free].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import MissingFileError

METALS = ("Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au")
ADSORBATES = ("O", "H", "N", "C", "OH", "CO", "NO", "CH", "NH")
SITES = ("fcc", "hcp", "ontop", "bridge")
PATCH = (3, 3, 2)                    # atoms along a, along b, layers
MAX_ATOMS = PATCH[0] * PATCH[1] * PATCH[2] + 2
FILE = "catalysis.h5"


def _ase():
    try:
        import ase  # noqa: F401
    except ImportError as missing:
        raise MissingFileError("the catalysis data set is written with ASE's EMT potential: "
                               "pip install ase (or exatrain[catalysis]).") from missing
    from ase import Atoms
    from ase.build import add_adsorbate, fcc111
    from ase.calculators.emt import EMT
    from ase.constraints import FixAtoms
    from ase.optimize import BFGS
    return Atoms, add_adsorbate, fcc111, EMT, FixAtoms, BFGS


def _adsorbate(name: str):
    """The adsorbate as ASE atoms, its binding atom (the first) at the origin, the rest above."""
    Atoms = _ase()[0]
    bond = {"OH": 0.97, "CO": 1.15, "NO": 1.15, "CH": 1.10, "NH": 1.04}
    if len(name) == 1:
        return Atoms(name)
    binding, other = name[0], name[1]
    return Atoms(binding + other, positions=[(0, 0, 0), (0, 0, bond[name])])


def relax_system(rng: np.random.Generator, frames: int, rattle: float) -> dict[str, np.ndarray]:
    """One system's first `frames` relaxation frames (fewer if it converges first)."""
    Atoms, add_adsorbate, fcc111, EMT, FixAtoms, BFGS = _ase()
    metal = METALS[rng.integers(len(METALS))]
    name = ADSORBATES[rng.integers(len(ADSORBATES))]
    slab = fcc111(metal, size=PATCH, vacuum=6.0)
    slab.pbc = False
    add_adsorbate(slab, _adsorbate(name), float(rng.uniform(1.3, 2.0)),
                  SITES[rng.integers(len(SITES))])
    fixed = slab.get_tags() == PATCH[2]              # fcc111 tags layers from the top: 1, 2, …
    slab.set_constraint(FixAtoms(mask=fixed))
    slab.positions[~fixed] += rng.normal(0.0, rattle, size=(int((~fixed).sum()), 3))
    slab.calc = EMT()
    record: dict[str, list] = {"z": [], "pos": [], "forces": [], "energy": []}

    def keep():
        # the frame as stored: float32 positions, EMT's energy and forces there
        frame = Atoms(slab.numbers, positions=slab.positions.astype(np.float32).astype(np.float64))
        frame.calc = EMT()
        record["z"].append(frame.numbers.copy())
        record["pos"].append(frame.positions.astype(np.float32))
        record["forces"].append(frame.get_forces().astype(np.float32))
        record["energy"].append(frame.get_potential_energy())

    optimizer = BFGS(slab, logfile=None)
    optimizer.attach(keep)
    optimizer.run(fmax=0.02, steps=frames - 1)       # the start and each step: `frames` frames
    n, count = len(slab), len(record["z"])
    out = {"z": np.zeros((count, MAX_ATOMS), np.uint8),
           "pos": np.zeros((count, MAX_ATOMS, 3), np.float32),
           "forces": np.zeros((count, MAX_ATOMS, 3), np.float32),
           "free": np.zeros((count, MAX_ATOMS), bool),
           "energy": np.asarray(record["energy"], np.float64)}
    out["z"][:, :n] = np.stack(record["z"])
    out["pos"][:, :n] = np.stack(record["pos"])
    out["forces"][:, :n] = np.stack(record["forces"])
    out["free"][:, :n] = ~fixed
    return out


def write_catalysis(out: str | Path, systems: int = 256, frames: int = 10, rattle: float = 0.15,
                    seed: int = 0, progress=None) -> dict:
    """Write out/catalysis.h5 (an existing file is kept) and say what it holds."""
    import h5py

    out = Path(out)
    path = out / FILE
    if not path.exists():
        import ase
        rng = np.random.default_rng(seed)
        parts = []
        for s in range(systems):
            part = relax_system(rng, frames, rattle)
            part["system"] = np.full(len(part["energy"]), s, np.int32)
            parts.append(part)
            if progress is not None:
                progress(s + 1, systems)
        out.mkdir(parents=True, exist_ok=True)
        partial = out / (FILE + ".partial")
        with h5py.File(partial, "w") as f:
            for key in parts[0]:
                f.create_dataset(key, data=np.concatenate([p[key] for p in parts]))
            f.attrs.update(calculator=f"EMT (ASE {ase.__version__})", seed=seed, rattle=rattle,
                           frames_per_system=frames, patch=PATCH, units="eV, Å, eV/Å")
        partial.replace(path)
    with h5py.File(path, "r") as f:
        count, systems_in = len(f["energy"]), int(f["system"][-1]) + 1
    return {"path": str(path), "frames": count, "systems": systems_in,
            "bytes": path.stat().st_size}


def describe_catalysis(path: str | Path) -> dict:
    """What a catalysis.h5 was written with: relaxations, frames per relaxation, seed."""
    import h5py

    with h5py.File(path, "r") as f:
        return {"systems": int(f["system"][-1]) + 1, "frames": int(f.attrs["frames_per_system"]),
                "seed": int(f.attrs["seed"])}


def load_catalysis(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of catalysis.h5 (`path` is the file or its directory)."""
    import h5py

    path = Path(path)
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise MissingFileError(f"{path}: no catalysis data; write it with `exatrain data "
                               f"catalysis --out {path.parent}` (or set data.generate = true).")
    with h5py.File(path, "r") as f:
        return {key: f[key][()] for key in f}


class CatalysisDataset(Dataset):
    """Frames `indices` of the arrays: (atoms (20, 4) [Z, x, y, z], target (20, 4) [F, free])."""

    def __init__(self, arrays: dict[str, np.ndarray], indices: np.ndarray):
        self.indices = np.asarray(indices)
        z = torch.from_numpy(arrays["z"][self.indices].astype(np.float32))
        self.atoms = torch.cat([z[..., None], torch.from_numpy(arrays["pos"][self.indices])], -1)
        free = torch.from_numpy(arrays["free"][self.indices].astype(np.float32))
        self.target = torch.cat([torch.from_numpy(arrays["forces"][self.indices]),
                                 free[..., None]], dim=-1)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.atoms[i], self.target[i]
