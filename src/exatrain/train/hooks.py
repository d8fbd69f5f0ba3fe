"""What a run composed into the Trainer adds at fixed points of its loop.

`Trainer.compose(hooks)` takes an object with these methods; `RunHooks` is the one that adds
nothing (an ordinary run). A population member (`population.member.PopulationMember`) holds its
tournaments here: the Trainer calls it, and it is given only what it uses when it is built.
"""

from __future__ import annotations


class RunHooks:
    #: True when a non-finite step is the hooks' business (`diverged`) rather than an error; the
    #: Trainer then reads the verdict every step
    handles_nonfinite = False

    def fit_begin(self) -> None:
        """Before the first step of `fit` (collective where the hooks need it)."""

    def record_fields(self, validation_s: float) -> dict:
        """Fields added to every metrics record; `validation_s`: seconds in validation passes
        since fit began."""
        return {}

    def after_step(self, step: int, history: list[dict]) -> bool:
        """After step `step`'s log and evaluation, before its checkpoint (the same step on every
        rank). `history`: the records so far. True when the run ends after this step."""
        return False

    def diverged(self) -> None:
        """A non-finite step was dropped (only with `handles_nonfinite`)."""

    def checkpoint_state(self) -> dict:
        """What the hooks add to a checkpoint's state."""
        return {}

    def load_state(self, state: dict) -> None:
        """Resume from a checkpoint's state (what `checkpoint_state` stored, among the rest)."""
