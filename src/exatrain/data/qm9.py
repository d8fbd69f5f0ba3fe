"""QM9 (134k small organic molecules, DFT properties) from the CSV files of the `qm9pack` wheel.

The package ships all of QM9 as CSV under `qm9pack/data/` (qm9_part1..3.csv: one molecule per
row with its elements, XYZ coordinates in Å and the properties in atomic units). We locate the
files with `importlib.util.find_spec` — without importing the package, whose module needs
pkg_resources and pandas — and convert them once (`convert_qm9`, `exatrain data qm9 --out DIR`)
into DIR/qm9.npz:

    index        (M,) int32     QM9's molecule number (gdb id), in file order
    n_atoms      (M,) int8
    z            (M, 29) uint8  atomic numbers, zero-padded to QM9's largest molecule (29 atoms)
    pos          (M, 29, 3) float32  coordinates in Å, zero-padded
    gap_hartree, homo_hartree, lumo_hartree   (M,) float64, exactly as in the CSV

`QM9Dataset` serves (atoms, gap_eV) with atoms = (29, 4) float32 rows [Z, x, y, z] (Z = 0:
padding), so the default collate stacks molecules of any size into one batch.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, MissingFileError

HARTREE_EV = 27.211386245988       # CODATA 2018
MAX_ATOMS = 29
ELEMENTS = {"H": 1, "C": 6, "N": 7, "O": 8, "F": 9}
MOLECULES = 130_831                # in the CSVs (QM9 minus the 3,054 that failed its checks)


def qm9_csv_files() -> list[Path]:
    """The qm9pack CSV files holding the molecules, in order; a clear error if not installed."""
    spec = importlib.util.find_spec("qm9pack")
    if spec is None or not spec.submodule_search_locations:
        raise MissingFileError("QM9 needs the `qm9pack` package (its wheel holds the data): "
                               "pip install qm9pack.")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = sorted(folder.glob("qm9_part*.csv"))
    if not files:
        raise MissingFileError(f"{folder}: no qm9_part*.csv files; reinstall qm9pack.")
    return files


def read_qm9_csv(files: list[Path] | None = None) -> dict[str, np.ndarray]:
    """Parse the CSV files into the arrays of qm9.npz."""
    csv.field_size_limit(1 << 27)
    index, n_atoms, gaps, homos, lumos, zs, positions = [], [], [], [], [], [], []
    for path in files or qm9_csv_files():
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader)
            col = {name: i for i, name in enumerate(header)}
            for row in reader:
                n = int(row[col["N_atoms"]])
                elements = row[col["Elements"]].strip("[]").replace("'", "").split(",")
                # "[[x,y,z],...]" with numbers such as "0." (not JSON): split on commas
                xyz = np.array(row[col["XYZ_Ang"]].replace("[", "").replace("]", "").split(","),
                               dtype=np.float64).reshape(-1, 3)
                if len(elements) != n or len(xyz) != n:
                    raise DataError(f"{path}: molecule {row[col['Index']]} lists {n} atoms but "
                                    f"{len(elements)} elements and {len(xyz)} positions.")
                index.append(int(row[col["Index"]]))
                n_atoms.append(n)
                gaps.append(float(row[col["HOMO_LUMO_gap_au"]]))
                homos.append(float(row[col["HOMO_au"]]))
                lumos.append(float(row[col["LUMO_au"]]))
                zs.append([ELEMENTS[e.strip()] for e in elements])
                positions.append(xyz)
    m = len(index)
    z = np.zeros((m, MAX_ATOMS), dtype=np.uint8)
    pos = np.zeros((m, MAX_ATOMS, 3), dtype=np.float32)
    for i, (zi, pi) in enumerate(zip(zs, positions)):
        z[i, :len(zi)] = zi
        pos[i, :len(pi)] = pi
    return {"index": np.asarray(index, dtype=np.int32), "n_atoms": np.asarray(n_atoms, np.int8),
            "z": z, "pos": pos, "gap_hartree": np.asarray(gaps), "homo_hartree": np.asarray(homos),
            "lumo_hartree": np.asarray(lumos)}


def convert_qm9(out: str | Path) -> dict:
    """Write out/qm9.npz from the installed CSVs (once; an existing file is kept)."""
    out = Path(out)
    path = out / "qm9.npz"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        arrays = read_qm9_csv()
        partial = out / "qm9.partial.npz"
        np.savez_compressed(partial, **arrays)
        partial.replace(path)
    with np.load(path) as z:
        count = len(z["index"])
    return {"path": str(path), "molecules": count, "bytes": path.stat().st_size}


def load_qm9(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of qm9.npz (`path` is the file or its directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "qm9.npz"
    if not path.is_file():
        raise MissingFileError(f"{path}: no QM9 file; write it with `exatrain data qm9 --out "
                               f"{path.parent}` (or set data.generate = true).")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


class QM9Dataset(Dataset):
    """Molecules `indices` of the arrays: (atoms (29, 4) [Z, x, y, z], HOMO–LUMO gap in eV)."""

    def __init__(self, arrays: dict[str, np.ndarray], indices: np.ndarray):
        self.indices = np.asarray(indices)
        z = torch.from_numpy(arrays["z"][self.indices].astype(np.float32))
        pos = torch.from_numpy(arrays["pos"][self.indices])
        self.atoms = torch.cat([z[..., None], pos], dim=-1)
        self.gap_ev = torch.from_numpy(arrays["gap_hartree"][self.indices] * HARTREE_EV).float()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.atoms[i], self.gap_ev[i]
