"""Which GPU a rank uses, the way centres bind them, and the refusal of two ranks on one GPU.

Schedulers show a rank its GPUs in one of two ways: all of the node's (torchrun, `srun
--gpu-bind=none`; the rank picks `LOCAL_RANK`'s), or only its own (`srun --gpus-per-task 1`,
`--gpu-bind=single:1`, a `CUDA_VISIBLE_DEVICES` per rank; the rank sees one GPU, index 0).
`gpu_index` covers both: the GPU at `local_rank mod visible`. What that cannot tell apart is a
binding that shows two ranks the same physical GPU (four ranks each given
`CUDA_VISIBLE_DEVICES=0`, two GPUs for four ranks), which NCCL fails on with an error far from the
cause. `refuse_shared_gpus` finds it before the process group starts: each rank claims its
GPU's UUID on the node in the rendezvous store (`compare_set`: the first claimant keeps it), all
ranks meet at a counter, then a rank whose GPU someone else claimed, and the claimant, both
refuse with the other's rank and the fix. Store traffic: a few small keys and two waits per rank.
"""

from __future__ import annotations

import socket

from .env import LaunchError

SHARE_HINT = ("set EXATRAIN_SHARE_GPU=1 to share the GPU over gloo (a check of multi-rank code, "
              "not a way to train fast)")


def gpu_index(local_rank: int, visible: int, rank: int = 0) -> int:
    """The index, among the GPUs this rank sees, of the one it uses: `local_rank mod visible`.

    Each rank sees all of the node's GPUs: the local rank's. Each sees only its own (one): 0.
    """
    if visible < 1:
        raise LaunchError(
            f"rank {rank}: this rank sees no GPU (CUDA_VISIBLE_DEVICES may be empty); bind one "
            "GPU per rank (srun --gpus-per-task 1) or set run.backend='gloo' to train on the CPU.")
    return local_rank % visible


def refuse_shared_gpus(store, rank: int, world: int, uuid: str, index: int,
                       generation: str = "0") -> None:
    """Refuse, on every rank involved, two ranks of the job on one physical GPU.

    `store` is the job's rendezvous store (before the process group wraps it); `generation`
    separates the claims of an elastic re-start, whose store lives on."""
    from torch.distributed import PrefixStore
    store = PrefixStore(f"exatrain_gpus/{generation}", store)
    host = socket.gethostname()
    key = f"{host}/{uuid}"
    owner = store.compare_set(key, "", str(rank)).decode()
    if owner != str(rank):
        store.set(f"{key}/also", str(rank))
    _meet(store, "claimed", world)
    if owner != str(rank):
        other = owner
    else:
        other = store.get(f"{key}/also").decode() if store.check([f"{key}/also"]) else None
    _meet(store, "read", world)  # rank 0 may host the store: no rank leaves before all have read
    if other is None:
        return
    raise LaunchError(
        f"rank {rank} and rank {other} use the same GPU {uuid} on {host} (cuda:{index} as rank "
        f"{rank} sees it); NCCL needs one GPU per rank. Start at most as many ranks per node as it "
        f"has GPUs, give each rank its own GPU (srun --gpus-per-task 1, or a CUDA_VISIBLE_DEVICES "
        f"per rank that differs), or {SHARE_HINT}.")


def _meet(store, name: str, world: int) -> None:
    """Wait until all `world` ranks reached `name` (a counter; the last arrival sets a flag)."""
    if store.add(name, 1) == world:
        store.set(f"{name}/all", "1")
    store.wait([f"{name}/all"])
