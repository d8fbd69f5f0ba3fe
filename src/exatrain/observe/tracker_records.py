"""What every tracker is given, whichever it is: the config flattened to `section.key`, a
metrics.jsonl record as numbers per step (what TensorBoard gets too), the summary's scalars, the
run's tags, and how the run ended (`Outcome`)."""

from __future__ import annotations

import dataclasses
import signal


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"train": {"steps": 2}} -> {"train.steps": 2} (lists and scalars kept as they are)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def rows(record: dict) -> dict[int, dict[str, float]]:
    """One metrics.jsonl record as {step: {key: number}}: the numbers TensorBoard gets."""
    step = record["step"]
    out: dict[int, dict[str, float]] = {step: {}}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)):
            out[step][key] = float(value)
        elif isinstance(value, dict):
            out[step].update({f"{key}/{sub}": float(v) for sub, v in value.items()
                              if isinstance(v, (int, float))})
        elif key == "step_losses":
            for i, loss in enumerate(value):
                out.setdefault(step - len(value) + 1 + i, {})["step_loss"] = float(loss)
    return dict(sorted(out.items()))


def scalar_summary(summary: dict) -> dict:
    """The summary's numbers and words (tables flattened to `key/sub`), for a run's summary."""
    out = {}
    for key, value in flatten(summary, "").items():
        key = key.replace(".", "/")
        if isinstance(value, (bool, int, float, str)) and value is not None:
            out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a tracked run ended, as each tracker records it: MLflow's run status (FINISHED,
    FAILED, KILLED), W&B's exit code (0 finished; 1 failed; 128 + the signal's number when
    stopped by a signal, the shell's convention W&B's documentation follows) and whether W&B is
    told the run is being preempted (a stop by a scheduler's signal, resumed later)."""
    status: str
    exit_code: int
    preempted: bool = False


def outcome(summary: dict | None, failure: BaseException | None,
            signum: int | None = None) -> Outcome:
    """The end of a run that returned `summary` or raised `failure`: a stop by SIGTERM/SIGUSR1
    (`stopped_by_signal`, checkpoint written) or an interrupt (Ctrl-C) is KILLED, any other
    exception FAILED. `signum`: the stop's signal where this rank received it (else SIGTERM,
    the scheduler's usual one, is assumed for the exit code)."""
    if failure is None and summary is not None and not summary.get("stopped_by_signal"):
        return Outcome("FINISHED", 0)
    if failure is None or isinstance(failure, KeyboardInterrupt):
        number = signal.SIGINT if isinstance(failure, KeyboardInterrupt) else \
            signum or signal.SIGTERM
        return Outcome("KILLED", 128 + int(number), preempted=failure is None)
    return Outcome("FAILED", 1)


def run_tags(config, trainer_mesh) -> dict[str, str]:
    """The tags of a run on `trainer_mesh` (a population member's: the job's mesh is its
    parent)."""
    import torch

    from ..version import __version__
    device = trainer_mesh.device
    name = device.type
    if device.type == "cuda":
        name = f"cuda:{torch.cuda.get_device_name(device)}"
    mesh = getattr(trainer_mesh, "parent", trainer_mesh)  # a population's: the whole job's
    tags = {"plan": str(mesh.plan), "world_size": str(mesh.world_size),
            "exatrain": __version__, "torch": torch.__version__, "device": name,
            "workload": config.run.workload}
    if mesh is not trainer_mesh:  # one trainer of a population
        tags.update(trainer=str(trainer_mesh.trainer), trainer_plan=str(trainer_mesh.plan))
    return tags
