"""run.host_memory: freed host memory stays in the process, so a step's tensors are not faulted in
anew every step (launch/host_memory.py). Each case runs in a fresh interpreter: malloc's settings
are process-wide."""

import os
import subprocess
import sys

import pytest

from exatrain.launch.host_memory import keep_freed_host_memory, why_not_keep
from exatrain.train.config import ConfigError, load_config

# a training step's pattern: tensors of 1-16 MiB allocated, written and freed, ten times over
_STEPS = """
import resource, sys, torch
from exatrain.launch.host_memory import keep_freed_host_memory
print(keep_freed_host_memory(sys.argv[1]), file=sys.stderr)
def step():
    tensors = [torch.ones(mib << 18) for mib in (1, 4, 8, 16, 2, 8)]
    del tensors
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
_PAGES_PER_STEP = (1 + 4 + 8 + 16 + 2 + 8) * (1 << 20) // 4096


# the cases' interpreters run without the caller's MALLOC_* choices, which would make "keep" a no-op
_ENV = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}


def _page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                          env=_ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


# Skipped only where exatrain itself leaves malloc alone (a C library other than glibc, or
# jemalloc/tcmalloc preloaded into every process): there "keep" is documented to do nothing.
@pytest.mark.skipif(why_not_keep(_ENV) != "",
                    reason=f"malloc is not glibc's here: {why_not_keep(_ENV)}")
def test_kept_host_memory_is_reused_not_faulted_in_every_step():
    kept, returned = _page_faults("keep"), _page_faults("return")
    # kept: ten steps fault in less than one step's pages (the first step's blocks are reused);
    # malloc's defaults hand the large blocks back and fault them in again
    assert kept < _PAGES_PER_STEP, (kept, returned)
    assert returned > 2 * kept, (kept, returned)


def test_a_users_malloc_choice_is_left_alone():
    assert "MALLOC_TRIM_THRESHOLD_" in why_not_keep({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert "jemalloc" in why_not_keep({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})


def test_an_unknown_host_memory_mode_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="run.host_memory='kept' is not one of keep, return"):
        load_config(None, ["run.host_memory='kept'"])
    with pytest.raises(ValueError, match="'keep'"):
        keep_freed_host_memory("on")
