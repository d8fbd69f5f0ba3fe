"""Pipeline schedules by name, which stages each rank holds, and each schedule's bubble formula.

p ranks on the pipe axis, v stages per rank (virtual stages), m micro-batches, S = p·v stages.
With equal forward (F), input-backward (B) and weight-backward (W) times per stage:

  gpipe        all forwards, then all backwards              bubble (p − 1) / (m + p − 1)
  1f1b         one forward, one backward in steady state     bubble (p − 1) / (m + p − 1)
               (GPipe's bubble, but at most p micro-batches' activations alive, not m)
  interleaved  1F1B over v looped stages per rank            bubble (p − 1) / (v·m + p − 1)
  zero_bubble  interleaved, backward split into B and W;     bubble (p − 1) / (3·v·m + p − 1)
               W fills the 1F1B bubble (ZB-H1: a third of it, Qi et al. 2023)

The bubble is the idle share of a rank's step: (p − 1) warm-up/cool-down slots of one stage's
work against the m (or v·m) slots of useful work.
"""

from __future__ import annotations

from ...errors import ConfigError

# name -> (schedule class in torch.distributed.pipelining, several stages per rank?). The class
# is looked up when a schedule is built: importing torch.distributed.pipelining pulls DTensor,
# torch._dynamo and sympy (~800 files), which a job without a pipe axis must not open (start-up).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved": ("ScheduleInterleaved1F1B", True),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True),
}


def check_schedule(name: str) -> None:
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.pipe_schedule={name!r} is not one of {', '.join(SCHEDULES)}.")


def virtual_stages(name: str, virtual: int) -> int:
    """Stages per rank: 1 for single-stage schedules, `virtual` (>= 2) for looped ones."""
    check_schedule(name)
    if not SCHEDULES[name][1]:
        return 1
    if virtual < 2:
        raise ConfigError(f"parallel.pipe_schedule={name!r} runs several stages per rank: "
                          f"set parallel.pipe_virtual_stages >= 2 (got {virtual}).")
    return virtual


def stage_indices(rank: int, ranks: int, per_rank: int) -> list[int]:
    """The stages held by `rank` of `ranks`: looped, rank r has r, r + p, r + 2p, ..."""
    return [rank + k * ranks for k in range(per_rank)]


def bubble_formula(name: str, ranks: int, microbatches: int, per_rank: int = 1) -> float:
    p, m, v = ranks, microbatches, per_rank
    work = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zero_bubble": 3 * v * m}[name]
    return (p - 1) / (work + p - 1)


def check_schedule_microbatches(name: str, ranks: int, microbatches: int) -> None:
    """Refuse, with the fix, what torch's schedules would reject only inside the first step:
    1f1b needs m ≥ p micro-batches (torch 2.13's Schedule1F1B raises at its first step, without
    saying which setting to change)."""
    if name == "1f1b" and microbatches < ranks:
        raise ConfigError(
            f"parallel.pipe_schedule='1f1b' needs at least as many micro-batches as "
            f"pipeline ranks: parallel.microbatches={microbatches} < plan.pipe={ranks}; "
            f"set parallel.microbatches >= {ranks} (the bubble shrinks as it grows), "
            "or use gpipe.")


def build_schedule(name: str, stages: list, microbatches: int, loss_fn):
    from torch.distributed import pipelining as pp

    cls_name, looped = SCHEDULES[name]
    cls = getattr(pp, cls_name)
    if looped:
        return cls(stages, microbatches, loss_fn=loss_fn)
    return cls(stages[0], microbatches, loss_fn=loss_fn)
