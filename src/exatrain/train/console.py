"""What rank 0 shows a person: a progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _fmt(record: dict) -> str:
    parts = [f"step {record['step']}"]
    for key, value in record.items():
        if key in ("step", "step_losses", "peak_mem_source"):
            continue
        if key == "bytes_per_step":
            parts.append("bytes/step " + " ".join(f"{a}={b / 2**20:.1f}MiB" for a, b in value.items()))
        elif key == "peak_mem_bytes":
            parts.append(f"peak_mem {value / 2**30:.2f}GiB")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
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
                                TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(),
                                console=console, transient=False)
            self.task = self.bar.add_task("train", total=total, completed=done, loss="-")
            self.bar.start()

    def advance(self, loss: float) -> None:
        if self.bar:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4g}")

    def log(self, record: dict) -> None:
        self.console.print(_fmt(record), highlight=False)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
