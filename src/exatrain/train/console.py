"""What rank 0 shows a person: a progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .units import human_bytes, human_value


# how a figure is named on a progress line (its unit already says what the number is)
_LABELS = {"samples_per_s": "", "tokens_per_s": "", "step_s": "step", "peak_mem_bytes": "peak mem",
           "state_bytes": "state", "peak_activation_bytes": "activations",
           "exposed_comm_s": "exposed comm", "exposed_comm_fraction": "=", "mfu": "MFU"}


def _fmt(record: dict) -> str:
    parts = [f"step {record['step']}"]
    for key, value in record.items():
        if key in ("step", "step_losses") or key.endswith("_source"):
            continue
        if key == "bytes_per_step":
            parts.append("bytes/step " + " ".join(f"{a}={human_bytes(b)}" for a, b in value.items()))
        elif key in ("peak_mem_bytes", "samples_per_s", "tokens_per_s", "step_s",
                     "exposed_comm_s", "exposed_comm_fraction", "mfu", "state_bytes",
                     "peak_activation_bytes") or (isinstance(value, float) and key != "lr"):
            label = _LABELS.get(key, key)
            parts.append(f"{label} {human_value(key, value)}".strip())
        elif key == "lr":
            parts.append(f"lr {value:.3g}")
    return "  ".join(parts)


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
        if console.is_terminal:
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"),
                                TextColumn("{task.fields[val]}"), TextColumn("ETA"),
                                TimeRemainingColumn(),
                                console=console, transient=False)
            self.task = self.bar.add_task("train", total=total, completed=done, loss="-", val="")
            self.bar.start()

    def advance(self, loss: float) -> None:
        if self.bar:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4g}")

    def log(self, record: dict) -> None:
        self.console.print(_fmt(record), highlight=False)
        if self.bar and "loss" not in record:  # a validation record: its first figure on the bar
            key = next((k for k in sorted(record) if k.startswith("val_")), None)
            if key:
                self.bar.update(self.task, val=f"{key} {record[key]:.4g}")

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
