"""Flight records: what each rank was doing when a collective hung, and who never arrived.

Every collective and point-to-point call through `exatrain.comm` is appended to its mesh's
`Ledger.recent` (kind, mesh axis, tag, payload bytes, step, peer world ranks, and `seq`: how many
operations this rank has issued on that axis group so far). When an operation runs out of
`run.timeout_s` -- or a rank's watchdog sees no progress for that long -- the rank writes

    RUN_DIR/flight/rank<R>.json   {"rank", "step", "reason", "recent": [...], "torch_fr": ...}

`torch_fr` is torch's own flight recorder (`_dump_fr_trace_json`, filled when
TORCH_FR_BUFFER_SIZE > 0; it records on gloo too), kept verbatim for deeper digging.

`diagnose(run_dir)` reads the records of all ranks: the operation that hung is the newest one
among the ranks' last operations; the ranks of its group whose count on that group is lower (or
that wrote no record) are the ones that did not arrive.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path


def flight_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "flight"


def _torch_flight_recorder() -> object:
    try:
        importlib.import_module("torch.distributed")  # loads the c10d extension
        from torch._C._distributed_c10d import _dump_fr_trace_json
        return json.loads(_dump_fr_trace_json())
    except Exception as exc:  # an older torch, or the recorder is off: the ledger still speaks
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def write_record(run_dir: str | Path, rank: int, ledger, reason: str) -> Path:
    """Write this rank's flight record (atomically); returns its path."""
    out = flight_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "pid": os.getpid(), "time": time.time(), "step": ledger.step,
              "reason": reason, "recent": list(ledger.recent), "torch_fr": _torch_flight_recorder()}
    path = out / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)
    return path


def _describe(op: dict) -> str:
    return (f"{op['op']} on mesh axis {op['axis']!r} (tag {op['tag'] or '-'}, {op['bytes']} B, "
            f"step {op['step']}, #{op['seq']} on ranks {op['peers']})")


def diagnose(run_dir: str | Path, world_size: int | None = None) -> str | None:
    """One paragraph naming the hung operation, its axis and the ranks that did not arrive;
    None when no rank wrote a flight record."""
    records = {}
    for path in sorted(flight_dir(run_dir).glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        records[int(record["rank"])] = record
    if not records:
        return None
    lasts = {r: rec["recent"][-1] for r, rec in records.items() if rec["recent"]}
    if not lasts:
        return f"flight records of ranks {sorted(records)} hold no operation yet."
    hung_rank, hung = max(lasts.items(), key=lambda item: (item[1]["seq"], item[1]["time"]))
    group = (hung["axis"], tuple(hung["peers"]))

    def count_on_group(rank: int) -> int:
        ops = [op for op in records[rank]["recent"] if (op["axis"], tuple(op["peers"])) == group]
        return max((op["seq"] for op in ops), default=0)

    members = hung["peers"] or list(range(world_size or 0))
    missing = [r for r in members if r not in records or count_on_group(r) < hung["seq"]]
    lines = [f"hang: {_describe(hung)} did not complete; "
             + (f"rank(s) {missing} did not arrive." if missing else
                "every member reached it (a backend or network failure, not a missing rank).")]
    for r in missing:
        if r not in records:
            lines.append(f"  rank {r}: wrote no flight record (dead, or stuck outside exatrain).")
        elif lasts.get(r):
            lines.append(f"  rank {r}: last operation {_describe(lasts[r])}; "
                         f"{records[r]['reason']}")
    lines.append(f"flight records: {flight_dir(run_dir)}")
    return "\n".join(lines)
