"""Start-up: files a rank opens from interpreter start to its first step, against `import torch`.

Baseline: a fresh interpreter's `import torch` (what any PyTorch job opens). exatrain: the same
interpreter's `import exatrain` and `exatrain run`'s parser, then `--nproc` ranks (torchrun-style
environment) of a tiny CosmoFlow job up to the end of their first step. Counts come from a Python audit hook
(observe.startup); times are wall seconds on this machine (one measurement: start-up is not
repeated warm, which would hide what a cold parallel file system pays).

Figures: torch_opens, exatrain_opens, exatrain_opens_beyond_torch (the figure to keep small),
exatrain_listdirs_beyond_torch, exatrain_modules_beyond_torch, torch_import_s, exatrain_import_s,
heavy_modules_at_import, run_parser_opens_beyond_torch and run_parser_modules_beyond_torch
(`import exatrain.cli` and the parser of `exatrain run` too), heavy_modules_at_run_parser,
first_step_opens_max, first_step_listdirs_max, first_step_s_max, first_step_modules_max (the
largest over ranks), heavy_modules_at_first_step (on any rank).
"""

from __future__ import annotations

import tempfile

from ..observe.startup import FIRST_STEP, measure_first_step, measure_import, summarise

TINY = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
        "data.samples=48", "train.batch_size=8", "train.eval_every=0", "observe.tensorboard=false"]


def add_arguments(parser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the first-step job (0: skip)")
    parser.add_argument("--config", default=None, help="the job's TOML (default: a tiny CosmoFlow)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override")


def run(args) -> dict:
    imported = measure_import()   # once, cold: a second import would find the files cached
    if args.nproc <= 0:
        return summarise(imported)
    with tempfile.TemporaryDirectory(prefix="exatrain-startup-") as tmp:
        overrides = ([] if args.config else TINY) + [f"data.path={tmp}/data",
                                                     f"run.out_dir={tmp}/runs", *(args.set or [])]
        from ..train.config import load_config
        from ..workloads import get_workload

        config = load_config(args.config, [*overrides, *FIRST_STEP])
        get_workload(config.run.workload).prepare(config)  # the data exist before the ranks start
        ranks = measure_first_step(args.config, overrides, args.nproc)
    return summarise(imported, ranks) | {"nproc": args.nproc}
