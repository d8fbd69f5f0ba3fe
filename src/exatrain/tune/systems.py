"""Systems: what a device computes and how fast its links move bytes, as small TOML files.

A system file (see `systems/*.toml`; `exatrain plan --calibrate` writes one for this machine):

    name, description
    ranks_per_node             ranks sharing the fast intra-node link
    memory_bytes               memory per rank; memory_reserved_bytes is kept back (context, caches)
    memory_bandwidth           bytes/s of that memory (the optimizer step streams the state)
    [flops]                    peak rate per dtype (fp32, tf32, bf16, fp16), FLOP/s per rank
    [efficiency]               fraction of peak a large matmul / convolution reaches
    [intra], [inter]           bandwidth (bytes/s per rank per direction), efficiency, latency (s);
                               small_latency (s) below small_bytes: the small-message regime
    [overheads]                seconds per call of the fixed costs (`tune.overheads`): op_s,
                               collective_s, fsdp_unit_s; step_error, the
                               model's measured relative error of a step on this system

Link of an axis: ranks are laid out row-major over Plan.degrees() (the innermost axis gets
neighbouring ranks, see `exatrain.mesh`), so a group lies within `stride × degree` consecutive
ranks of its outermost dimension; it stays on one node when that span fits in `ranks_per_node`,
otherwise it crosses nodes.

Collective time for a payload of B bytes (the ledger's convention) on n ranks: the bandwidth term
of a ring, the latency term of a tree (NCCL and gloo switch to trees / recursive doubling where
latency dominates, so a ring's n-1 latency steps would grossly overcharge thousands of ranks):

    all_reduce                 2⌈log2 n⌉·α + 2(n-1)/n · B / β
    all_gather, reduce_scatter ⌈log2 n⌉·α + (n-1)/n · B / β
    broadcast                  like all_gather (pipelined)
    send / recv                α + B / β

with α the link latency of the message's size regime (`Link.alpha`) and β its bandwidth ×
efficiency. A user adds a system by writing a file into the user's systems folder
(`user_systems_dir`: $EXATRAIN_SYSTEMS_DIR, else ~/.config/exatrain/systems), or by passing a
path to `--system`. A name is looked up there first, then among the files shipped with the
package; `exatrain plan --calibrate` and `--calibrate-from` write there, never into the installed
package (which a site install keeps read-only).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArgumentError, MissingFileError

SYSTEMS_DIR = Path(__file__).parent / "systems"   # the files shipped with the package
SYSTEMS_ENV = "EXATRAIN_SYSTEMS_DIR"


def user_systems_dir() -> Path:
    """The user's systems: $EXATRAIN_SYSTEMS_DIR, else $XDG_CONFIG_HOME/exatrain/systems
    (~/.config/exatrain/systems)."""
    if os.environ.get(SYSTEMS_ENV):
        return Path(os.environ[SYSTEMS_ENV])
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "exatrain" / "systems"


def system_file(name_or_path: str) -> Path:
    """A system's file: a path as given (it has a suffix), else the user's file of that name,
    else the shipped one (which may not exist: the caller says so)."""
    path = Path(name_or_path)
    if path.suffix:
        return path
    mine = user_systems_dir() / f"{name_or_path}.toml"
    return mine if mine.is_file() else SYSTEMS_DIR / f"{name_or_path}.toml"


@dataclass(frozen=True)
class Link:
    bandwidth: float          # bytes/s per rank per direction
    latency: float            # seconds per message step
    efficiency: float = 1.0
    # the small-message regime: below small_bytes a message step costs small_latency (gloo
    # and NCCL switch algorithms and protocols there); 0: one regime
    small_latency: float = 0.0
    small_bytes: float = 0.0

    def alpha(self, nbytes: float) -> float:
        """α of a message of `nbytes` (its size regime's latency)."""
        return self.small_latency if self.small_bytes and nbytes < self.small_bytes \
            else self.latency

    @property
    def rate(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class System:
    name: str
    ranks_per_node: int
    memory_bytes: float
    flops: dict
    efficiency: dict
    intra: Link
    inter: Link
    memory_reserved_bytes: float = 0.0
    memory_bandwidth: float = 0.0                  # bytes/s of device memory (optimizer step)
    description: str = ""
    measured: dict = field(default_factory=dict)   # what calibration measured, for the record
    overheads: dict = field(default_factory=dict)  # seconds per call (`tune.overheads`)

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes - self.memory_reserved_bytes

    def rate(self, dtype: str, kind: str = "matmul") -> float:
        """Achievable FLOP/s of one rank for `kind` (matmul | conv) in `dtype`."""
        peak = self.flops.get(dtype) or self.flops["fp32"]
        return peak * self.efficiency.get(kind, self.efficiency.get("matmul", 1.0))

    def link(self, span: int) -> Link:
        """The link of a group whose ranks lie within `span` consecutive ranks."""
        return self.intra if span <= self.ranks_per_node else self.inter


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one collective of `nbytes` payload on `n` ranks over `link` (module doc)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    rounds = math.ceil(math.log2(n))
    if op == "all_reduce":
        steps, wire = 2 * rounds, 2 * (n - 1) / n * nbytes
    elif op in ("all_gather", "reduce_scatter", "broadcast"):
        steps, wire = rounds, (n - 1) / n * nbytes
    elif op in ("send", "recv", "p2p"):
        steps, wire = 1, nbytes
    else:
        raise ValueError(f"unknown collective {op!r}")
    return steps * link.alpha(nbytes) + wire / link.rate


def _link(table: dict, where: str) -> Link:
    try:
        return Link(float(table["bandwidth"]), float(table["latency"]),
                    float(table.get("efficiency", 1.0)), float(table.get("small_latency", 0.0)),
                    float(table.get("small_bytes", 0.0)))
    except KeyError as exc:
        raise ArgumentError(f"{where}: missing key {exc}; give bandwidth (bytes/s), latency (s) "
                            "and optionally efficiency") from None


def from_dict(raw: dict, where: str = "system") -> System:
    missing = [k for k in ("name", "ranks_per_node", "memory_bytes", "flops", "intra", "inter")
               if k not in raw]
    if missing:
        raise ArgumentError(f"{where}: missing {', '.join(missing)} (see {SYSTEMS_DIR}/*.toml)")
    return System(name=raw["name"], ranks_per_node=int(raw["ranks_per_node"]),
                  memory_bytes=float(raw["memory_bytes"]),
                  memory_reserved_bytes=float(raw.get("memory_reserved_bytes", 0)),
                  memory_bandwidth=float(raw.get("memory_bandwidth", 0)),
                  flops={k: float(v) for k, v in raw["flops"].items()},
                  efficiency={k: float(v) for k, v in raw.get("efficiency", {}).items()},
                  intra=_link(raw["intra"], f"{where} [intra]"),
                  inter=_link(raw["inter"], f"{where} [inter]"),
                  description=raw.get("description", ""), measured=raw.get("measured", {}),
                  overheads={k: float(v) for k, v in raw.get("overheads", {}).items()})


def available() -> list[str]:
    return sorted({p.stem for d in (user_systems_dir(), SYSTEMS_DIR) for p in d.glob("*.toml")})


def load_system(name_or_path: str) -> System:
    """A system by name (the user's file of that name, else the shipped one) or by path to a
    TOML file."""
    path = system_file(name_or_path)
    if not path.is_file():
        hint = " Run `exatrain plan --calibrate` to measure this machine into cpu-local." \
            if name_or_path == "cpu-local" else ""
        raise MissingFileError(f"--system {name_or_path}: no such system; known: "
                               f"{', '.join(available())}, or give a path to a TOML file.{hint}")
    return from_dict(tomllib.loads(path.read_text()), str(path))
