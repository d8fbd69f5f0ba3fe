"""What rank 0 shows a person: a progress bar on a terminal, plain log lines otherwise.

On a terminal, a live bar shows the step, the loss, the rate (samples/s, and the input wait
when the record has `data_wait_s`), the last validation figure, the elapsed time and the ETA;
every `train.log_every` steps one line with all figures is printed above it. When the output is
not a terminal (a batch log, a pipe), there is no bar: one plain line per log interval, never
wrapped, that starts with `step N/TOTAL (P %)` and carries the ETA, so a log read later says
how far the run got and when it would have ended.

Communication is shown as `comm/step` with each mesh axis's bytes; the axis that spans every
rank (the ledger's `trainer+pipe+data+shard+space+tensor`: losses, metrics and control
messages) is called `all ranks`.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from ..plan import AXIS_ORDER
from .fields import format_value
from .units import human_bytes, human_seconds, human_value


# how a figure is named on a progress line (its unit already says what the number is)
_LABELS = {"samples_per_s": "", "tokens_per_s": "", "step_s": "step", "peak_mem_bytes": "peak mem",
           "state_bytes": "state", "peak_activation_bytes": "activations",
           "exposed_comm_s": "exposed comm", "exposed_comm_fraction": "=", "mfu": "MFU",
           "data_wait_s": "input wait", "data_wait_fraction": "=",
           "compiled_graphs": "compiled graphs", "graph_breaks": "graph breaks"}
_NAMED = ("peak_mem_bytes", "samples_per_s", "tokens_per_s", "step_s", "exposed_comm_s",
          "exposed_comm_fraction", "mfu", "state_bytes", "peak_activation_bytes", "data_wait_s",
          "data_wait_fraction", "compiled_graphs", "graph_breaks")


def axis_label(axis: str) -> str:
    """A ledger axis as a reader says it: the axis over every rank is `all ranks`."""
    return "all ranks" if set(axis.split("+")) == set(AXIS_ORDER) else axis


def comm_text(bytes_per_step: dict, prefix: str = "comm/step ") -> str:
    """`comm/step pipe 528 B, all ranks 4 B`: the bytes of this rank's collectives per step, by
    mesh axis, as the communication ledger counts them."""
    return prefix + (", ".join(f"{axis_label(a)} {human_bytes(b)}"
                               for a, b in bytes_per_step.items()) or "-")


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The run summary as the console prints it: one row per key of summary.json, named by that
    key (so a figure read on the console is found in the file by the same name), its value in
    the unit its row of `fields` gives; lists and tables in words."""
    rows = []
    for key, value in summary.items():
        if key == "memory_per_rank":  # a list per rank: its largest figures are what matter
            value = "max over ranks: state " \
                + human_bytes(max(r["state_bytes"] or 0 for r in value)) \
                + ", peak " + human_bytes(max(r["peak_mem_bytes"] or 0 for r in value))
        elif key == "bandwidth_drops":  # see docs/how-to/preflight.md
            value = "; ".join(f"step {d['step']}: {d['axis']} ({d['op']})" for d in value) \
                or "none"
        elif key == "bytes_per_step":  # the ledger's bytes per step, by mesh axis
            value = comm_text(value, prefix="")
        elif key == "restart_history":
            value = "; ".join(f"failed after step {h['failed_after_step']}, resumed from step "
                              f"{h['resumed_from_step']}" for h in value) or "none"
        else:
            value = format_value(key, value)
        rows.append((key, str(value)))
    return rows


def _fmt(record: dict) -> str:
    parts = [f"step {record['step']}"]
    for key, value in record.items():
        if key in ("step", "step_losses") or key.endswith("_source"):
            continue
        if key == "bytes_per_step":
            parts.append(comm_text(value))
        elif key in _NAMED or (isinstance(value, float) and key != "lr"):
            label = _LABELS.get(key, key)
            parts.append(f"{label} {human_value(key, value)}".strip())
        elif key == "lr":
            parts.append(f"lr {value:.3g}")
    return "  ".join(parts)


def _rate(record: dict) -> str:
    """The bar's rate field: samples/s (tokens/s when counted), and the input wait if known."""
    key = "tokens_per_s" if "tokens_per_s" in record else "samples_per_s"
    if key not in record:
        return ""
    text = human_value(key, record[key])
    wait = record.get("data_wait_s")
    return text + (f"  input wait {human_seconds(wait)}" if wait is not None else "")


class TrainConsole:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)

    def print(self, *args, **kwargs):
        self.console.print(*args, **kwargs)

    def progress(self, total: int, done: int = 0) -> "_Bar":
        return _Bar(self.console, total, done)


class _Bar:
    def __init__(self, console: Console, total: int, done: int):
        self.console = console
        self.bar = None
        self.total, self.done, self.first = total, done, done
        self.start = time.perf_counter()
        if console.is_terminal:
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"),
                                TextColumn("{task.fields[rate]}"),
                                TextColumn("{task.fields[val]}"), TimeElapsedColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(),
                                console=console, transient=False)
            self.task = self.bar.add_task("train", total=total, completed=done, loss="-",
                                          rate="", val="")
            self.bar.start()

    def advance(self) -> None:
        """One step done (its loss reaches the bar with the next log record)."""
        self.done += 1
        if self.bar:
            self.bar.update(self.task, advance=1)

    def eta_s(self) -> float | None:
        """Seconds left at the mean pace of the steps taken since this bar started."""
        taken = self.done - self.first
        if taken <= 0 or not self.total:
            return None
        return (time.perf_counter() - self.start) / taken * max(self.total - self.done, 0)

    def _position(self) -> str:
        if not self.total:
            return ""
        eta = self.eta_s()
        return (f"/{self.total} ({100 * self.done / self.total:.0f} %"
                + (f", ETA {human_seconds(eta)})" if eta is not None else ")"))

    def log(self, record: dict) -> None:
        if self.bar:
            self.console.print(_fmt(record), highlight=False)
            if "loss" in record:
                self.bar.update(self.task, rate=_rate(record), loss=f"{record['loss']:.4g}")
            else:  # a validation record: its first figure on the bar
                key = next((k for k in sorted(record) if k.startswith("val_")), None)
                if key:
                    self.bar.update(self.task, val=f"{key} {record[key]:.4g}")
            return
        line = _fmt(record)
        if "loss" in record:  # `step N/TOTAL (P %, ETA ...)` on a training line
            head = f"step {record['step']}"
            line = head + self._position() + line[len(head):]
        # one line per interval: a batch log is read with grep, so never wrap it
        self.console.print(line, highlight=False, soft_wrap=True, markup=False)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def work_progress(console: Console, label: str):
    """A callback(done, total) for long work before training (writing a data set): a bar with
    rate and ETA on a terminal, else a plain line every tenth of the way with the same figures."""
    state: dict = {"start": None, "bar": None}

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if state["start"] is None:
            state["start"] = now
            if console.is_terminal:
                state["bar"] = Progress(TextColumn(f"[bold]{label}"), BarColumn(),
                                        MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                                        TimeElapsedColumn(), TextColumn("ETA"),
                                        TimeRemainingColumn(), console=console)
                state["task"] = state["bar"].add_task(label, total=total, rate="")
                state["bar"].start()
        elapsed = now - state["start"]
        rate = done / elapsed if elapsed > 0 else 0.0
        if state["bar"] is not None:
            state["bar"].update(state["task"], completed=done,
                                rate=f"{rate:.3g}/s" if rate > 0 else "")
            if done >= total:
                state["bar"].stop()
            return
        if done == total or done % max(1, total // 10) == 0:
            eta = (total - done) / rate if rate > 0 else None
            console.print(f"{label}: {done}/{total} ({100 * done / max(total, 1):.0f} %"
                          + (f", {rate:.3g}/s, ETA {human_seconds(eta)})" if eta is not None
                             else ")"), highlight=False, soft_wrap=True, markup=False)
    return report
