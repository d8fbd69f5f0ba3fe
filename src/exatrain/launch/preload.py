"""What every rank imports, imported once with the garbage collector paused, then frozen.

A forkserver imports this module before it forks ranks (`launch.local`, the tests' rank pools),
and a rank started by an outside launcher (`exatrain run` under srun, torchrun, ...) calls
`import_rank_modules` as it starts. The modules: torch, torch._dynamo (which torch's optimizers
import as the first one is built, whether or not anything is compiled) and exatrain, which any
import of this module imports first (its `__init__` pauses the collector for itself).

Why paused: the imports make over a million objects and none of them is garbage, yet the
collector would pass over them again and again as they come. Measured (2 cores, 2026-11-29): a
fresh interpreter's `import exatrain` took 1.45 s of CPU, 1.2 s paused; `torch._dynamo` after it
1.08 s, 0.74 s paused.

Why frozen (`gc.freeze`): the collector never traverses these objects again. A rank's later
collections skip them, and a forked rank does not write into the pages it shares with its
server on every pass, which would copy those pages to it one at a time (copy-on-write).
"""

from __future__ import annotations

import gc


def import_rank_modules() -> None:
    """Import torch and torch._dynamo with the collector paused; freeze what this process has
    made so far. Idempotent: a second call only freezes again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


# a forkserver's preload imports this module by name: importing it is the whole request
import_rank_modules()
