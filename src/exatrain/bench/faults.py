"""Fault tolerance: injected rank kills under automatic restart, a hang, checkpoint cost.

One launch runs, on `--nproc` local gloo ranks, a tiny CosmoFlow (16³, 4 conv layers):

  reference   uninterrupted, synchronous checkpoints every `--every` steps
  kills       the same run with `--kills` ranks SIGKILLed at random steps (seeded by --seed; the
              second kill hits inside a checkpoint write, after the shard files and before the
              commit), restarted by `train.resilience.restart.supervise` (= `exatrain run
              --max-restarts`), with asynchronous checkpoints (DCP async_save)
  hang        a rank that stops joining collectives at step 3, with run.timeout_s = --timeout

Figures:
  kills, restarts       injected kills and the restarts they caused
  lost_steps            steps computed twice: per kill, the last step in metrics.jsonl minus the
                        checkpoint step the restart resumed from (train.log_every = 1)
  final_weights_equal   the exported safetensors files of both runs are byte-identical
  hang_detect_s         from the hang (its fault marker's time) to the last rank's exit
  timeout_s             run.timeout_s of the hang run (target: hang_detect_s <= timeout_s + 30)
  checkpoint_s          time the training loop is blocked per synchronous save (reference)
  checkpoint_s_async    the same with async_save (the kills run's last attempt)
  checkpoint_bytes      bytes of one checkpoint (model + optimizer + manifest)

`--recovery` runs instead what one failure costs under a plain restart, an elastic re-formation
and torchft's replica groups, beside the uninterrupted run (bench/faults_recovery.py).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

TINY = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
        "data.generate=false", "train.batch_size=8", "train.log_every=1", "optim.lr=0.003",
        "train.eval_every=0"]


def add_arguments(parser) -> None:
    parser.add_argument("--kills", type=int, default=3, help="rank kills to inject")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--every", type=int, default=0,
                        help="checkpoint every N steps (0: 2, with --recovery 10)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="run.timeout_s of the hang run (0: 5), with --recovery of every "
                             "run (0: 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill steps and ranks")
    parser.add_argument("--recovery", action="store_true",
                        help="instead: one failure under a plain restart, an elastic "
                             "re-formation and torchft's replica groups, beside the "
                             "uninterrupted run (default 40 steps)")
    parser.add_argument("--kill-step", type=int, default=0,
                        help="with --recovery: the step the failure hits (0: half a checkpoint "
                             "interval past the middle checkpoint)")


def _kill_plan(kills: int, steps: int, every: int, nproc: int, seed: int) -> list[tuple]:
    """(kind, rank, step) per kill, steps increasing so that each fires once."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(2, steps), kills))
    plan = []
    for i, step in enumerate(chosen):
        kind = "kill"
        if i == 1:  # the second kill: inside the checkpoint write at the next checkpoint step
            kind, step = "kill_in_save", max(step, plan[-1][2] + 1 if plan else 0)
            step = -(-step // every) * every
        plan.append((kind, rng.randrange(nproc), step))
    for a, b in zip(plan, plan[1:]):  # keep them strictly increasing after the rounding
        if b[2] <= a[2]:
            raise ValueError(f"--kills {kills} do not fit in {steps} steps; raise --steps.")
    return plan


def _checkpoint_bytes(run_dir: Path) -> int:
    from ..train.checkpoints import checkpoint
    last = checkpoint.latest(run_dir)
    return sum(p.stat().st_size for p in last.iterdir() if p.is_file())


def run(args) -> dict:
    if args.recovery:
        return _recovery(args)
    import os

    from ..data.cosmoflow_synth import write_cosmoflow
    from ..launch.local import RankFailed
    from ..comm.flight import flight_dir
    from ..train.config import load_config
    from ..train.checkpoints.export import export_run
    from ..train.resilience.faults import ENV
    from ..train.resilience.restart import supervise
    from ..train.run import run_job

    steps = args.steps or 4 * args.kills + 6
    nproc = args.nproc
    args.every, args.timeout = args.every or 2, args.timeout or 5.0
    plan = _kill_plan(args.kills, steps, args.every, nproc, args.seed)
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-faults-") as tmp:
        tmp = Path(tmp)
        write_cosmoflow(tmp / "data", samples=48, size=16, seed=3)

        def config(name: str, *extra: str):
            return load_config(None, [*TINY, f"data.path={tmp / 'data'}", f"run.out_dir={tmp / name}",
                                      f"train.steps={steps}", f"train.checkpoint_every={args.every}",
                                      "train.checkpoint_keep=3", *extra])

        reference = supervise(run_job, config("reference"), nproc, None, 0, report=lambda _: None)
        os.environ[ENV] = ",".join(f"{kind}@{rank}:{step}" for kind, rank, step in plan)
        try:
            faulty = supervise(run_job, config("kills", "train.checkpoint_async=true"), nproc, None,
                               args.kills, report=lambda _: None)
        finally:
            del os.environ[ENV]
        files = []
        for run_summary in (reference, faulty):
            out = tmp / f"{Path(run_summary['run_dir']).name}.safetensors"
            export_run(run_summary["run_dir"], out)
            files.append(out.read_bytes())

        os.environ[ENV] = f"hang@{nproc - 1}:3"
        hang_config = config("hang", f"run.timeout_s={args.timeout}")
        try:
            supervise(run_job, hang_config, nproc, None, 0, report=lambda _: None)
            raise RuntimeError("the injected hang was not detected")
        except RankFailed as exc:
            ended = time.time()
            diagnosis = getattr(exc, "diagnosis", None) or ""
        finally:
            del os.environ[ENV]
        hang_dir = next(Path(tmp / "hang").iterdir())
        marker = next((hang_dir / "faults").iterdir())
        records = sorted(p.name for p in flight_dir(hang_dir).glob("rank*.json"))
        saves = max(1, steps // args.every)
        return {"kills": len(plan), "restarts": faulty["restarts"], "lost_steps": faulty["lost_steps"],
                "final_weights_equal": files[0] == files[1],
                "hang_detect_s": ended - marker.stat().st_mtime, "timeout_s": args.timeout,
                "checkpoint_s": reference["checkpoint_blocked_s"] / saves,
                "checkpoint_s_async": faulty["checkpoint_blocked_s"] / max(1, faulty["checkpoint_saves"]),
                "checkpoint_bytes": _checkpoint_bytes(Path(reference["run_dir"])),
                "kill_plan": ",".join(f"{k}@{r}:{s}" for k, r, s in plan), "steps": steps,
                "nproc": nproc, "flight_records": ",".join(records),
                "hang_diagnosis": diagnosis.splitlines()[0] if diagnosis else ""}


def _recovery(args) -> dict:
    from ..data.cosmoflow_synth import write_cosmoflow
    from .faults_recovery import kill_step, measure, print_table

    if args.nproc != 2:
        raise ValueError(f"--recovery runs on 2 ranks (two nodes, two replica groups), not "
                         f"--nproc {args.nproc}; leave --nproc out.")
    steps, every = args.steps or 40, args.every or 10
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-recovery-") as tmp:
        tmp = Path(tmp)
        write_cosmoflow(tmp / "data", samples=48, size=16, seed=3)
        result = measure(tmp / "data", tmp, steps, every, kill_step(steps, every, args.kill_step),
                         args.timeout or 10.0)
    print_table(result)
    return result
