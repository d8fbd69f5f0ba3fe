"""Bus bandwidth per mesh axis, watched step by step: a link that slows down mid-run is named.

Per step and per axis (as the ledger names axes), from what the ledger already records:

    bus bytes  = sum over the step's collectives of bytes * comm.busbw.bus_factor(op, n)
    seconds    = the time this rank was blocked in them (ledger.blocked_s) + the launch-to-done
                 span of asynchronous ones (DDP's gradient buckets, ledger.async_s)
    busbw      = bus bytes / seconds

Steps that moved fewer than `min_bytes` bus bytes on an axis (control flags, metric sums: latency,
not bandwidth) are left out. An axis's reference is the median busbw of its last `window` normal
steps, after `warmup` steps; a step below `fraction` times that reference is low, and is not added
to the reference. Every `check_every` steps the ranks agree (one MAX all-reduce of one int32 over
the world, tag "control", 4 bytes per rank) whether any rank has seen `patience` low steps in a
row on some axis (at the Trainer's first read point after those steps); if so, one all-gather of
each rank's facts (host, blocked seconds and bus bytes per axis over the low steps, the ranks it
shares each axis with) names the axis, its busiest operation and the ranks that waited longest,
once per axis per run. A drop is thus reported at most patience + check_every steps after it
begins, plus the steps to the next read point.

A rank's blocked time includes waiting for a peer that arrives late (a descheduled process, a slow
node's compute); the peer that arrives last waits for the transfer alone. So a drop is the link's
only when, in some group of the axis, each low step's shortest time among the group's ranks is
still low (`link_dropped`); a late rank alone makes its peers look slow, not itself, and is no
bandwidth drop (the low steps are then forgotten).

`observe.on_bandwidth_drop`: "warn" (default) reports and goes on; "stop" also asks the Trainer to
checkpoint and stop after this step, as a wall-time signal does (train.stop).
"""

from __future__ import annotations

import socket
import statistics
import sys
from collections import defaultdict, deque

import torch

from ..comm import all_gather_object, all_reduce
from ..comm.busbw import bus_factor

POLICIES = ("warn", "stop")
UNWATCHED_TAGS = ("control",)  # agreement flags: a few bytes, pure latency


class BandwidthWatch:
    def __init__(self, mesh, options, is_main: bool):
        if options.on_bandwidth_drop not in POLICIES:
            from ..errors import ConfigError
            raise ConfigError(f"observe.on_bandwidth_drop={options.on_bandwidth_drop!r}: use one "
                              f"of {', '.join(POLICIES)}")
        self.mesh, self.ledger, self.options, self.is_main = mesh, mesh.ledger, options, is_main
        self.reference: dict[str, deque] = defaultdict(lambda: deque(maxlen=options.bandwidth_window))
        self.low: dict[str, int] = defaultdict(int)      # consecutive low steps per axis
        # the last `patience` judged steps per axis: (seconds blocked, bus bytes)
        self.recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=options.bandwidth_patience))
        self.last: dict[str, dict] = {}                  # the newest step's figures per axis
        self.steps = 0
        self.reported: set[str] = set()
        self.drops: list[dict] = []
        self.stop_requested = False
        self._mark: tuple = ()
        self._unchecked = 0  # steps since the ranks last agreed

    def _counters(self) -> tuple:
        return self.ledger.snapshot(), dict(self.ledger.blocked_s), dict(self.ledger.async_s)

    def step_begin(self) -> None:
        self._mark = self._counters()

    def step_end(self, step: int, may_agree: bool = True) -> list[dict]:
        """After a step: update every axis; agree (collective) on drops at the first step that
        `may_agree` (the Trainer's read points: a step between them reads nothing from the
        device) once `check_every` steps have passed since the last agreement. Returns the drops
        reported now (the same list on every rank)."""
        entries0, blocked0, async0 = self._mark
        entries, blocked, asynchronous = self._counters()
        bus, by_op = defaultdict(float), defaultdict(lambda: defaultdict(int))
        for (axis, op, tag), (_calls, nbytes) in entries.items():
            moved = nbytes - entries0.get((axis, op, tag), (0, 0))[1]
            if moved and tag not in UNWATCHED_TAGS:
                bus[axis] += moved * bus_factor(op, self.ledger.sizes.get(axis, 2))
                by_op[axis][op] += moved
        self.steps += 1
        o = self.options
        for axis, nbytes in bus.items():
            seconds = blocked.get(axis, 0.0) - blocked0.get(axis, 0.0) + \
                asynchronous.get(axis, 0.0) - async0.get(axis, 0.0)
            if nbytes < o.bandwidth_min_bytes or seconds <= 0:
                continue
            busbw = nbytes / seconds
            self.last[axis] = {"busbw": busbw, "op": max(by_op[axis], key=by_op[axis].get)}
            self.recent[axis].append((seconds, nbytes))
            ref = self.reference[axis]
            if self.steps > o.bandwidth_warmup and len(ref) >= o.bandwidth_patience and \
                    busbw < o.bandwidth_drop_fraction * statistics.median(ref):
                self.low[axis] += 1
                self.last[axis]["reference"] = statistics.median(ref)
            else:
                self.low[axis] = 0
                if self.steps > o.bandwidth_warmup:
                    ref.append(busbw)
        self._unchecked += 1
        if not may_agree or self._unchecked < o.bandwidth_check_every:
            return []
        self._unchecked = 0
        return self._agree(step)

    def _dropped(self) -> list[str]:
        return sorted(a for a, n in self.low.items()
                      if n >= self.options.bandwidth_patience and a not in self.reported)

    def _peers(self) -> dict[str, list[int]]:
        """Per axis, the ranks this one has exchanged with on it (its group; for point-to-point
        its partners), itself included, as world ranks."""
        out: dict[str, set] = defaultdict(set)
        for axis, peers in self.ledger.calls_on:
            if len(peers) > 1:
                out[axis].update(peers)
        return {axis: sorted(peers) for axis, peers in out.items()}

    def _agree(self, step: int) -> list[dict]:
        flag = torch.tensor([1 if self._dropped() else 0], dtype=torch.int32, device=self.mesh.device)
        all_reduce(flag, self.mesh.world, op=torch.distributed.ReduceOp.MAX, tag="control")
        if not flag.item():
            return []
        world = self.mesh.world
        mine = {"rank": self.mesh.rank, "host": socket.gethostname(), "dropped": self._dropped(),
                "waits": {a: sum(s for s, _ in w) for a, w in self.recent.items()},
                "last": self.last, "recent": {a: list(w) for a, w in self.recent.items()},
                "global_rank": world.global_rank(world.rank),
                "peers": self._peers()}
        every = all_gather_object(mine, world)
        axes = sorted({a for r in every for a in r["dropped"]})
        now = []
        for axis in axes:
            if not link_dropped(axis, every, self.options.bandwidth_drop_fraction):
                self.low[axis] = 0  # a late rank, not the link: every rank forgets alike
                continue
            seen = [r for r in every if axis in r["last"] and "reference" in r["last"][axis]]
            first = seen[0]["last"][axis] if seen else every[0]["last"].get(axis, {})
            longest = sorted((r for r in every if axis in r["waits"]),
                             key=lambda r: -r["waits"][axis])[:3]
            drop = {"step": step, "axis": axis, "op": first.get("op"),
                    "busbw_GBps": first.get("busbw", float("nan")) / 1e9,
                    "reference_GBps": first.get("reference", float("nan")) / 1e9,
                    "fraction": self.options.bandwidth_drop_fraction,
                    "steps_low": self.options.bandwidth_patience,
                    "longest_waits": [{"rank": r["rank"], "host": r["host"],
                                       "wait_s": r["waits"][axis]} for r in longest]}
            now.append(drop)
            self.reported.add(axis)
        self.drops.extend(now)
        if now and self.options.on_bandwidth_drop == "stop":
            self.stop_requested = True
        if self.is_main:
            for d in now:
                print(describe(d) + ("; stopping after this step with a checkpoint "
                                     "(observe.on_bandwidth_drop = \"stop\")"
                                     if self.stop_requested else ""), file=sys.stderr, flush=True)
        return now


def link_dropped(axis: str, every: list[dict], fraction: float) -> bool:
    """Whether the low steps some rank saw on `axis` were the link's: for a rank that saw them
    (in `every`, each rank's gathered facts), each of those steps' shortest blocked time among
    the ranks of its group on the axis -- the one that arrived last, who waited for the transfer
    alone -- still gives a bus bandwidth below `fraction` of that rank's reference. True as well
    when a group's facts are incomplete (better a report than a missed slow link)."""
    by_rank = {r["global_rank"]: r for r in every}
    for flagged in (r for r in every if axis in r["dropped"]):
        members = [by_rank.get(p) for p in flagged["peers"].get(axis, ())]
        if not members or any(m is None or not m["recent"].get(axis) for m in members):
            return True
        reference = flagged["last"][axis]["reference"]
        steps = min(len(m["recent"][axis]) for m in members)
        if all(flagged["recent"][axis][-k][1] / min(m["recent"][axis][-k][0] for m in members)
               < fraction * reference for k in range(1, steps + 1)):
            return True
    return False


def describe(drop: dict) -> str:
    waits = ", ".join(f"rank {w['rank']} ({w['host']}) {w['wait_s']:.3f} s" for w in
                      drop["longest_waits"])
    return (f"exatrain: step {drop['step']}: bus bandwidth of axis {drop['axis']!r} "
            f"({drop['op']}) fell to {drop['busbw_GBps']:.3g} GB/s, below "
            f"{drop['fraction']:g} x its median {drop['reference_GBps']:.3g} GB/s for "
            f"{drop['steps_low']} steps in a row; longest waits over those steps: {waits}. "
            f"A slow link or node: `exatrain preflight` names it (docs/how-to/preflight.md)")
