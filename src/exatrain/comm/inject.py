"""Injected slow links for tests and drills: a rank that sleeps inside its collectives.

EXATRAIN_INJECT_SLOW="RANK:SECONDS[:AXIS[:FROM_STEP]]", comma-separated; RANK may be `*` (every
rank), AXIS a ledger axis name (`data`, `pipe`, `world`'s long name ...) or `*` (every axis,
the default), FROM_STEP the first step (as metrics.jsonl numbers them) that is slowed (default:
from the start, including anything before the first step such as `exatrain preflight`).

  "2:0.01"          rank 2 sleeps 10 ms in every collective: a slow rank or NIC
  "*:0.05:data:6"   from step 6 on, every data-axis collective takes 50 ms longer: a link
                    that degraded in the middle of a run

The sleep happens inside `comm.timing.comm_range`, before the backend call, so it is counted as
blocked time on this rank and every peer of the collective waits for it, as it would for a slow
transport. Without the variable nothing is injected (one attribute test per collective). The
injector lives on the mesh's ledger: no global state.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import UserError

ENV = "EXATRAIN_INJECT_SLOW"


class InjectError(UserError, ValueError):
    """A fault injected for testing is misspelt: `EXATRAIN_INJECT_SLOW` (a slow link) is not
    `RANK:SECONDS[:AXIS[:FROM_STEP]]`, or `EXATRAIN_INJECT_FAULTS` (a crash, hang or NaN) is not
    `kind@rank:step`.

    What to do: write it as the message shows, or unset it.
    """


@dataclass(frozen=True)
class SlowLink:
    seconds: float
    axis: str = "*"
    from_step: int = 0


class SlowLinks:
    """The delays that apply to one rank, looked up per (axis, ledger step)."""

    def __init__(self, links: list[SlowLink]):
        self.links = links

    @classmethod
    def parse(cls, text: str, rank: int) -> "SlowLinks | None":
        links = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            parts = item.split(":")
            try:
                who, seconds = parts[0], float(parts[1])
                axis = parts[2] if len(parts) > 2 and parts[2] else "*"
                from_step = int(parts[3]) if len(parts) > 3 else 0
            except (IndexError, ValueError):
                raise InjectError(f"{ENV}: {item!r} is not RANK:SECONDS[:AXIS[:FROM_STEP]], e.g. "
                                  f"'2:0.01' or '*:0.05:data:6'") from None
            if who != "*" and not who.isdigit():
                raise InjectError(f"{ENV}: {item!r}: RANK must be a number or '*'")
            if who == "*" or int(who) == rank:
                links.append(SlowLink(seconds, axis, from_step))
        return cls(links) if links else None

    @classmethod
    def from_env(cls, rank: int) -> "SlowLinks | None":
        text = os.environ.get(ENV, "")
        return cls.parse(text, rank) if text else None

    def delay(self, axis: str, step: int) -> None:
        seconds = sum(link.seconds for link in self.links
                      if link.axis in ("*", axis) and step >= link.from_step)
        if seconds > 0:
            time.sleep(seconds)
