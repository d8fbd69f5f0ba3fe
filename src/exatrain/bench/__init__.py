"""Benchmarks: each runs the PyTorch baseline and exatrain in one launch and writes flat JSON.

A benchmark module defines `add_arguments(parser)` (its own options, besides the common
--steps/--warmup/--size) and `run(args) -> dict`; `run_benchmark` prints the figures as a table.
`BENCHMARKS` names one module per benchmark; a benchmark too long for one module keeps its parts
beside it, named after it (device_*.py, kfac_branches.py, kfac_plot.py, pipe_memory.py,
planner_local.py).

Imports: everything below bench, the public API (`import exatrain as et`, as a user does) too;
only the cli imports bench (tests/test_import_graph.py).
"""

from __future__ import annotations

import importlib

from rich.console import Console
from rich.table import Table

BENCHMARKS = {"dp": "exatrain.bench.dp", "spatial": "exatrain.bench.spatial",
              "zero": "exatrain.bench.zero", "tensor": "exatrain.bench.tensor",
              "graph": "exatrain.bench.graph", "pipeline": "exatrain.bench.pipeline",
              "ltfb": "exatrain.bench.ltfb", "faults": "exatrain.bench.faults",
              "planner": "exatrain.bench.planner", "data": "exatrain.bench.data",
              "device": "exatrain.bench.device", "kfac": "exatrain.bench.kfac",
              "chanfilt": "exatrain.bench.chanfilt", "startup": "exatrain.bench.startup",
              "trackers": "exatrain.bench.trackers"}


def bench_module(name: str):
    return importlib.import_module(BENCHMARKS[name])


def add_common_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=0, help="timed steps per variant (0: default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant")
    parser.add_argument("--size", type=int, default=0, help="model/input size (0: default)")


def run_benchmark(name: str, args) -> dict:
    result = bench_module(name).run(args)
    table = Table(title=f"exatrain bench {name}", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if isinstance(value, (list, dict)) and len(str(value)) > 60:   # curves: in the JSON
            table.add_row(key, f"{len(value)} entries (--json)")
            continue
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
    return result
