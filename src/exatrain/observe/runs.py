"""Reading what a run directory holds: metrics.jsonl, summary.json, config.toml."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MissingFileError


@dataclass
class RunRecord:
    path: Path
    train: list[dict] = field(default_factory=list)   # records with a training loss
    evals: list[dict] = field(default_factory=list)   # records with validation metrics
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def workload(self) -> str:
        return self.config.get("run", {}).get("workload", "?")

    @property
    def world_size(self) -> int:
        return int(self.summary.get("world_size") or 1)

    @property
    def plan(self) -> str:
        return str(self.summary.get("plan", "?"))

    def step_losses(self) -> tuple[list[int], list[float]]:
        """Every step's loss (records hold the losses of their logging interval)."""
        steps, losses = [], []
        for r in self.train:
            values = r.get("step_losses") or [r["loss"]]
            first = r["step"] - len(values) + 1
            steps += range(first, r["step"] + 1)
            losses += values
        return steps, losses


def read_run(path: str | Path) -> RunRecord:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise MissingFileError(f"{path}: no metrics.jsonl here; give a run directory as "
                               "`exatrain run` writes it (runs/<workload>-<time>/).")
    run = RunRecord(path)
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        (run.train if "loss" in record else run.evals).append(record)
    if (path / "summary.json").is_file():
        run.summary = json.loads((path / "summary.json").read_text())
    if (path / "config.toml").is_file():
        run.config = tomllib.loads((path / "config.toml").read_text())
    return run
