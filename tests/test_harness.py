"""The rank pool's failure reports: a rank that crashes in native code, or that never returns,
is named with what its fault handler wrote (a forked rank's stderr reaches no test's output)."""

import pytest

from exatrain.launch.local import RankFailed
from harness import run_ranks


def _crash_on_rank_one():
    import ctypes
    import os

    if os.environ["RANK"] == "1":
        ctypes.string_at(0)  # SIGSEGV, as gloo reading a CUDA tensor's memory from the host
    return "ok"


def _stuck_on_rank_one():
    import os
    import time

    if os.environ["RANK"] == "1":
        time.sleep(60)
    return "ok"


def test_a_rank_killed_by_a_signal_is_named_with_the_signal_and_its_stack():
    with pytest.raises(RankFailed) as info:
        run_ranks(2, _crash_on_rank_one, timeout_s=60)
    message = str(info.value)
    assert "rank 1 died (killed by SIGSEGV)" in message, message
    assert "_crash_on_rank_one" in message and "rank1's stacks" in message, message


def _stuck_on_rank_one_after_a_fit():
    from exatrain.train.resilience.stop import StopOnSignal

    StopOnSignal().install().restore()   # what every Trainer.fit does around its steps
    return _stuck_on_rank_one()


@pytest.mark.parametrize("stuck", [_stuck_on_rank_one, _stuck_on_rank_one_after_a_fit],
                         ids=["plain", "after-a-fit"])
def test_a_stuck_rank_is_reported_with_where_it_waits(stuck):
    """Its stacks name the function it waits in; after a fit too (the stop signals' handler a
    fit installs and restores leaves the stacks' signal alone)."""
    with pytest.raises(RankFailed) as info:
        run_ranks(2, stuck, timeout_s=5)
    message = str(info.value)
    stacks = message.partition("rank1's stacks")[2]
    assert "no result within 5 s" in message and "in _stuck_on_rank_one" in stacks, message
    assert run_ranks(2, _returns_ok) == ["ok", "ok"]  # a fresh pool serves the next case


def _returns_ok():
    return "ok"


def _returns_what_cannot_travel():
    return lambda: None


def test_a_result_that_cannot_be_sent_is_an_error_not_a_wait():
    with pytest.raises(RankFailed) as info:
        run_ranks(2, _returns_what_cannot_travel, timeout_s=60)
    assert "could not send its result" in str(info.value), str(info.value)
