"""Run hooks composed into a Trainer (`Trainer.compose`): called at their points of the loop, their
record fields in every metrics line, their state in the checkpoint and back on resume, and a
run they end stops after that step (how a population member's tournaments and target work)."""

from __future__ import annotations

import json
from pathlib import Path

from exatrain.train.hooks import RunHooks
from exatrain.train.run import find_resume_checkpoint, setup


class Recorder(RunHooks):
    def __init__(self, stop_at: int):
        self.stop_at, self.calls, self.loaded = stop_at, [], None

    def fit_begin(self) -> None:
        self.calls.append("fit_begin")

    def record_fields(self, validation_s: float) -> dict:
        return {"hooked": True}

    def after_step(self, step: int, history: list[dict]) -> bool:
        self.calls.append((step, history[-1]["step"] if history else None))
        return step == self.stop_at

    def checkpoint_state(self) -> dict:
        return {"recorder": {"calls": len(self.calls)}}

    def load_state(self, state: dict) -> None:
        self.loaded = state["recorder"]


def test_hooks_are_called_write_their_fields_and_state_and_end_the_run(tiny_config, one_thread):
    config = tiny_config("train.steps=5", "train.log_every=1", "train.eval_every=0",
                         "train.checkpoint_every=2")
    mesh, trainer = setup(config)
    try:
        hooks = Recorder(stop_at=2)
        trainer.compose(hooks)
        summary = trainer.fit()
        run_dir = Path(trainer.run_dir)
    finally:
        mesh.close()
    assert summary["steps"] == 2  # ended by the hooks after step 2, not at train.steps
    assert hooks.calls == ["fit_begin", (1, 1), (2, 2)]  # after each step's record
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(line["hooked"] for line in lines)
    mesh, trainer = setup(config)
    try:
        again = Recorder(stop_at=0)
        trainer.compose(again)
        state = trainer.resume(find_resume_checkpoint(str(run_dir)))
    finally:
        mesh.close()
    assert state["step"] == 2 and again.loaded == {"calls": 3}  # as saved after step 2
