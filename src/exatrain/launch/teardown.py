"""A rank's distributed state ended in order, before its interpreter exits.

A process group that outlives the rank's code is destroyed during the interpreter's
finalization, in whatever order modules and objects are cleared: gloo's worker and transport
threads and, on the rank that hosts it, the TCPStore server's thread are then joined while the
interpreter is half gone. A rank under srun or torchrun (a whole interpreter that exits)
sometimes printed `terminate called without an active exception` there. So every rank's last
act, after success and after a failure, is `tear_down()`: `exatrain run` calls it as it returns,
a spawned rank before it exits, and `mesh.init` registers it to run at exit where it made a
launched job's group (a user's script under srun or torchrun); and `mesh.init` keeps torch from
holding the default group in a module for ever (see there).
"""

from __future__ import annotations

import gc


def tear_down() -> None:
    """Destroy every process group, then collect the objects that still referred to one (meshes,
    axes, trainers: reference cycles), so that their threads are joined now, in this order, while
    the interpreter is whole. Loader workers and the trainer's threads are stopped before this,
    where they were started (`Trainer.fit`, `Prefetcher.close`). Local to this rank: no
    collective, so a rank may call it while its peers have failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
