"""What one rank's start-up asks of the file system: files opened and directories listed.

Each measurement runs in a fresh interpreter that installs a Python audit hook
(`sys.addaudithook`) before anything else, counting the audit events

  open         every file opened through Python (sources, .pyc, extension modules, data, config)
  os.listdir   directory listings (the import system's path-entry caches list each sys.path
  os.scandir   directory once per process, and each package directory it searches)

and taking marks: after `import torch` (the baseline: what any PyTorch job pays), after
`import exatrain`, after `import exatrain.cli` and building its parser for `exatrain run` (what
`srun exatrain run` does on every rank before training), and at the end of the first training
step (the audit event "exatrain.step_end" that the Trainer's observer raises after every step;
for older trees without it, rank 0's first open of RUN_DIR/metrics.jsonl, with
train.log_every = 1). Each mark also names the HEAVY_MODULES imported by then. `stat` calls
are not audit events; count them with `strace -f -c -e trace=%file` (docs/how-to/startup.md).
On a parallel file system every one of these is a metadata request to a single server, from
every rank at once.

The first-step measurement runs `nproc` ranks as torchrun would start them (RANK, WORLD_SIZE,
MASTER_ADDR ... in the environment), each in its own measured interpreter; the data are written
beforehand, so the counts are what a rank of a real job opens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Modules a training rank must not import before it needs them: each costs hundreds of files
# (sympy, DTensor, torch._dynamo) or is not training at all (the planner, the benchmarks).
HEAVY_MODULES = ("sympy", "mpmath", "matplotlib", "safetensors", "torch.utils.tensorboard",
                 "torch.distributed.pipelining", "torch.distributed.checkpoint",
                 "torch.distributed.tensor", "torch._dynamo", "mlperf_logging", "scipy",
                 "exatrain.tune", "exatrain.bench")

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
counts = {"open": 0, "os.listdir": 0, "os.scandir": 0}
marks = {}
def mark(name):
    marks[name] = dict(counts, wall_s=time.perf_counter() - t0, modules=len(sys.modules),
                       heavy=sorted(m for m in HEAVY if m in sys.modules))
def hook(event, args):
    if event in counts:
        counts[event] += 1
    if "first_step" not in marks and (event == "exatrain.step_end" or
            event == "open" and str(args[0]).endswith("metrics.jsonl")):
        mark("first_step")
sys.addaudithook(hook)
import torch
mark("torch")
import exatrain
mark("exatrain")
from exatrain.cli import build_parser
try:
    build_parser(["run"])
except TypeError:   # an older tree, whose parser is always built whole
    build_parser()
mark("cli")
if len(sys.argv) > 1:
    from exatrain.train.config import load_config
    from exatrain.train.run import run_job
    run_job(load_config(sys.argv[1] or None, json.loads(sys.argv[2])))
print("EXATRAIN_STARTUP " + json.dumps(marks))
""".replace("HEAVY", repr(HEAVY_MODULES))


def _probe(args: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _marks(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    line = next((l for l in out.splitlines() if l.startswith("EXATRAIN_STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"start-up probe failed (exit code {proc.returncode}):\n{err[-3000:]}")
    return json.loads(line.removeprefix("EXATRAIN_STARTUP "))


def measure_import(timeout: float = 300) -> dict:
    """Counts at `import torch` and `import exatrain` in a fresh interpreter."""
    return _marks(_probe([]), timeout)


FIRST_STEP = ["train.log_every=1", "train.steps=1"]  # the overrides of the measured job


def measure_first_step(config_path: str | None, overrides: list[str], nproc: int = 2,
                       timeout: float = 600) -> list[dict]:
    """Counts per rank up to the end of the first step of a job of `nproc` ranks. The job's data
    must exist before (the caller prepares them: observe sits below the run it measures)."""
    from ..launch.local import free_port

    overrides = [*overrides, *FIRST_STEP]
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
        procs.append(_probe([config_path or "", json.dumps(overrides)], env=env))
    return [_marks(p, timeout) for p in procs]


def summarise(imported: dict, ranks: list[dict] | None = None) -> dict:
    """Flat figures: opens and listings at each mark, and beyond torch's own."""
    t, e, c = imported["torch"], imported["exatrain"], imported["cli"]
    out = {"torch_opens": t["open"], "exatrain_opens": e["open"],
           "exatrain_opens_beyond_torch": e["open"] - t["open"],
           "exatrain_listdirs_beyond_torch": e["os.listdir"] + e["os.scandir"]
           - t["os.listdir"] - t["os.scandir"],
           "exatrain_modules_beyond_torch": e["modules"] - t["modules"],
           "torch_import_s": t["wall_s"], "exatrain_import_s": e["wall_s"] - t["wall_s"],
           "heavy_modules_at_import": ",".join(e["heavy"]) or "none",
           "run_parser_opens_beyond_torch": c["open"] - t["open"],
           "run_parser_modules_beyond_torch": c["modules"] - t["modules"],
           "heavy_modules_at_run_parser": ",".join(c["heavy"]) or "none"}
    if ranks:
        first = [r["first_step"] for r in ranks if "first_step" in r]
        out.update(first_step_opens_max=max(f["open"] for f in first),
                   first_step_listdirs_max=max(f["os.listdir"] + f["os.scandir"] for f in first),
                   first_step_s_max=max(f["wall_s"] for f in first),
                   first_step_modules_max=max(f["modules"] for f in first),
                   heavy_modules_at_first_step=",".join(sorted({m for f in first
                                                                 for m in f["heavy"]})) or "none")
    return out
