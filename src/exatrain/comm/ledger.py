"""The communication ledger: calls and payload bytes of every collective, per mesh axis.

Every collective exatrain issues goes through `exatrain.comm`, which records it here. One Ledger
belongs to one `Mesh` (no global state); the Trainer reads it each step and reports bytes per axis.

Byte convention (payload, per rank, independent of the algorithm the backend uses):
  all_reduce       bytes of the tensor
  all_gather       bytes of the gathered (full) output
  reduce_scatter   bytes of the full input
  broadcast        bytes of the tensor
  send / recv      bytes of the tensor sent / received
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

FLIGHT_LENGTH = 64  # operations kept for the flight record (see comm.flight)


@dataclass
class Entry:
    calls: int = 0
    bytes: int = 0


@dataclass
class Ledger:
    """Counts keyed by (axis, op, tag); `tag` says what for, e.g. "grad", "halo", "metric"."""

    entries: dict = field(default_factory=lambda: defaultdict(Entry))
    # seconds the calling thread was blocked in communication, per axis (see comm.timing)
    blocked_s: dict = field(default_factory=lambda: defaultdict(float))

    def add_blocked(self, axis: str, seconds: float) -> None:
        self.blocked_s[axis] += seconds

    def blocked_total(self) -> float:
        return sum(self.blocked_s.values())

    # (launch, done) perf_counter times of collectives that someone else waits on (DDP's reducer)
    async_spans: list = field(default_factory=list)

    # seconds from launch to completion of those async collectives, per axis (comm.bandwidth)
    async_s: dict = field(default_factory=lambda: defaultdict(float))

    def add_async_span(self, launched: float, done: float, axis: str = "") -> None:
        self.async_spans.append((launched, done))
        if axis:
            self.async_s[axis] += done - launched

    def drain_async_tail(self) -> float:
        """Seconds from the last launch to the last completion of the recorded async collectives.

        The last launch comes when the last gradient bucket is ready, i.e. when backward's compute
        is done; what is still in flight then cannot hide behind compute: it is exposed.
        """
        spans, self.async_spans = self.async_spans, []
        if not spans:
            return 0.0
        return max(0.0, max(d for _, d in spans) - max(launch for launch, _ in spans))

    # the last operations, newest last, for the flight record written when one hangs
    recent: deque = field(default_factory=lambda: deque(maxlen=FLIGHT_LENGTH))
    step: int = 0                 # set by the Trainer: the step the next operations belong to
    calls_on: dict = field(default_factory=lambda: defaultdict(int))  # per (axis, peers)
    last_time: float = field(default_factory=time.time)
    sizes: dict = field(default_factory=dict)  # members of each axis seen (for bus bandwidth)
    slow: object = None           # injected delays (comm.inject.SlowLinks), None in a real run

    def record(self, axis: str, op: str, nbytes: int, tag: str = "", peers: tuple = ()) -> None:
        entry = self.entries[(axis, op, tag)]
        entry.calls += 1
        entry.bytes += int(nbytes)
        group = (axis, tuple(peers))
        self.calls_on[group] += 1
        if len(peers) > 1:
            self.sizes[axis] = len(peers)
        self.last_time = time.time()
        self.recent.append({"seq": self.calls_on[group], "op": op, "axis": axis, "tag": tag,
                            "bytes": int(nbytes), "step": self.step, "peers": list(peers),
                            "time": self.last_time})

    def bytes_by_axis(self, tag: str | None = None) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (axis, _op, t), entry in self.entries.items():
            if tag is None or t == tag:
                out[axis] += entry.bytes
        return dict(out)

    def calls_by_axis(self, tag: str | None = None) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (axis, _op, t), entry in self.entries.items():
            if tag is None or t == tag:
                out[axis] += entry.calls
        return dict(out)

    def total_bytes(self, tag: str | None = None) -> int:
        return sum(self.bytes_by_axis(tag).values())

    def snapshot(self) -> dict[tuple, tuple[int, int]]:
        return {k: (e.calls, e.bytes) for k, e in self.entries.items()}

    def since(self, snapshot: dict) -> "Ledger":
        """A new Ledger holding what was recorded after `snapshot` was taken."""
        delta = Ledger()
        for key, entry in self.entries.items():
            calls0, bytes0 = snapshot.get(key, (0, 0))
            if entry.calls > calls0:
                delta.entries[key] = Entry(entry.calls - calls0, entry.bytes - bytes0)
        return delta

    def reset(self) -> None:
        self.entries.clear()
        self.blocked_s.clear()
        self.async_spans.clear()
        self.async_s.clear()
