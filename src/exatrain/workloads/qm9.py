"""QM9 workload: SchNet or DimeNet++ predicting the HOMO–LUMO gap (eV) of real molecules.

`model.name` picks the model: "schnet" (the default; models/schnet.py) or "dimenet++"
(models/dimenet.py). `features`, `interactions` and `cutoff` are both models' hidden width,
number of interaction blocks and cutoff (Å); `rbf` is SchNet's number of Gaussians; `radial`,
`spherical`, `int_emb`, `basis_emb`, `out_emb` and `envelope_exponent` are DimeNet++'s (defaults:
the paper's; its hidden width and blocks are 128 and 4, set them with features/interactions).

Data: qm9.npz converted once from the qm9pack CSVs (data/qm9.py). A fixed random permutation
(seed `data.seed`) of the 130,831 molecules gives `data.val_molecules` for validation and the
next `data.train_molecules` for training (0 = all the rest). Loss: L1 on the gap in eV (what
the field reports); validation: the gap MAE in eV against `baseline_mae`, the MAE of predicting
the training mean. Many molecules per batch (see models/schnet.py); `plan.data` replicas split
each batch.

References: SchNet's published gap MAE on QM9 is 63 meV (0.063 eV; Schütt et al., J. Chem.
Phys. 148, 241722 (2018), Table 2, 110k training molecules, trained for days on a GPU);
DimeNet++'s is 32.6 meV (Gasteiger et al., arXiv:2011.14115 (2020), 110k training molecules,
3 million steps of 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data.qm9 import QM9Dataset, convert_qm9, load_qm9
from ..errors import ConfigError
from ..models.dimenet import DimeNetPlusPlus
from ..models.schnet import SchNet
from .base import InputOptions, Workload

PUBLISHED_SCHNET_GAP_MAE_EV = 0.063
PUBLISHED_DIMENET_PP_GAP_MAE_EV = 0.0326
MODELS = ("schnet", "dimenet++")


@dataclass
class ModelOptions:
    name: str = "schnet"            # the model: "schnet" or "dimenet++" (models/dimenet.py)
    features: int = 64              # hidden width: features per atom (SchNet) or per edge
                                    # (DimeNet++; its paper: 128)
    interactions: int = 3           # interaction blocks, each residual (DimeNet++'s paper: 4)
    rbf: int = 32                   # SchNet: Gaussian radial basis functions of each distance (K)
    cutoff: float = 5.0
    radial: int = 6                 # DimeNet++: radial (Bessel) functions
    spherical: int = 7              # DimeNet++: spherical harmonics (l < spherical)
    int_emb: int = 64               # DimeNet++: triplet width of the ++ bottleneck
    basis_emb: int = 8              # DimeNet++: width the spherical basis is projected through
    out_emb: int = 256              # DimeNet++: output blocks' width
    envelope_exponent: int = 5      # DimeNet++: the bases' envelope, a polynomial from x^(e+1),
                                    # zero with two derivatives at the cutoff

    workload: ClassVar[str] = "QM9"   # named in the refusal (the catalysis workload's: its own)

    def __post_init__(self):
        if self.name not in MODELS:
            raise ConfigError(f"model.name={self.name!r} is not a {self.workload} model; choose "
                              f"one of {', '.join(repr(n) for n in MODELS)}.")


@dataclass
class DataOptions(InputOptions):
    path: str = "data/qm9"          # directory of qm9.npz
    generate: bool = True           # convert the qm9pack CSVs there if missing
    train_molecules: int = 0        # 0 = every molecule not held out for validation
    val_molecules: int = 10000
    seed: int = 0


def prepare(config, progress=None) -> Path:
    d = config.data
    if d.generate and not (Path(d.path) / "qm9.npz").exists():
        convert_qm9(d.path)
    return Path(d.path)


def build(config, mesh) -> Workload:
    m, d = config.model, config.data
    arrays = load_qm9(d.path)
    order = np.random.default_rng(d.seed).permutation(len(arrays["index"]))
    val_idx = order[:d.val_molecules]
    rest = order[d.val_molecules:]
    train_idx = rest[:d.train_molecules] if d.train_molecules else rest
    train_set, val_set = QM9Dataset(arrays, train_idx), QM9Dataset(arrays, val_idx)
    mean = float(train_set.gap_ev.double().mean())
    std = float(train_set.gap_ev.double().std())
    model = build_model(m, mean, std)

    def metric_sums(output, target):
        return {"abs_err": (output.float() - target).abs().sum(),
                "count": torch.tensor(float(target.numel()))}

    def finalize(s):
        return {"val_gap_mae_ev": s["abs_err"] / s["count"]}

    baseline = float((val_set.gap_ev.double() - mean).abs().mean())
    return Workload(model=model, train_set=train_set, val_set=val_set, loss_fn=F.l1_loss,
                    metric_sums=metric_sums, finalize=finalize,
                    baselines={"baseline_mae": baseline,
                               "published_schnet_gap_mae_ev": PUBLISHED_SCHNET_GAP_MAE_EV,
                               "published_dimenet_pp_gap_mae_ev": PUBLISHED_DIMENET_PP_GAP_MAE_EV})


def build_model(m: ModelOptions, mean: float = 0.0, std: float = 1.0, max_z: int = 10,
                readout: str = "mean"):
    """The model `m.name` names, predicting mean + std · (its standardised output), for atomic
    numbers below `max_z`; `readout`: SchNet's over atoms ("sum" for an energy)."""
    if m.name == "schnet":
        return SchNet(features=m.features, interactions=m.interactions, rbf=m.rbf,
                      cutoff=m.cutoff, max_z=max_z, target_mean=mean, target_std=std,
                      readout=readout)
    if m.name == "dimenet++":
        return DimeNetPlusPlus(hidden=m.features, blocks=m.interactions, int_emb=m.int_emb,
                               basis_emb=m.basis_emb, out_emb=m.out_emb, radial=m.radial,
                               spherical=m.spherical, cutoff=m.cutoff,
                               envelope_exponent=m.envelope_exponent, max_z=max_z,
                               target_mean=mean, target_std=std)
    raise ConfigError(f"model.name={m.name!r} is not a QM9 model; choose one of "
                      f"{', '.join(repr(n) for n in MODELS)}.")   # as ModelOptions checks
