"""Which GPU a rank uses (all of the node's GPUs visible, or only its own), and two ranks on one
physical GPU refused on every rank involved, through a real rendezvous store between processes.
The GPU case at the end runs where CUDA is at hand (scripts/gpu-figures.sh runs it)."""

import multiprocessing as mp
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from exatrain.launch import LaunchError
from exatrain.launch.gpus import gpu_index, refuse_shared_gpus
from exatrain.launch.local import free_port


@pytest.mark.parametrize("local_rank, visible, expected", [
    (0, 4, 0), (3, 4, 3),          # torchrun, srun --gpu-bind=none: all of the node's GPUs
    (0, 1, 0), (3, 1, 0),          # srun --gpus-per-task 1: each rank sees its own GPU only
    (5, 4, 1),                     # more ranks than visible GPUs: the refusal below names it
])
def test_a_rank_uses_the_gpu_at_its_local_rank_mod_the_gpus_it_sees(local_rank, visible, expected):
    assert gpu_index(local_rank, visible) == expected


def test_a_rank_that_sees_no_gpu_is_told_how_to_bind_one():
    with pytest.raises(LaunchError, match=r"rank 7: this rank sees no GPU.*--gpus-per-task 1"):
        gpu_index(0, 0, rank=7)


def _claim(port, rank, world, uuid, results):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=150))  # slow spawns on a busy CPU
    try:
        refuse_shared_gpus(store, rank, world, uuid, 0)
        results.put((rank, "ok"))
    except LaunchError as e:
        results.put((rank, str(e)))


def _claims(uuids):
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_claim, args=(port, r, len(uuids), u, results))
             for r, u in enumerate(uuids)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=180) for _ in procs)  # spawning is slow on a busy CPU
    for p in procs:
        p.join(30)
    return out


def test_ranks_on_their_own_gpus_pass_and_two_on_one_gpu_are_both_refused_by_name():
    out = _claims(["GPU-aaaa", "GPU-bbbb", "GPU-aaaa"])
    assert out[1] == "ok"
    for rank, other in ((0, 2), (2, 0)):
        assert f"rank {rank} and rank {other} use the same GPU GPU-aaaa" in out[rank]
        assert "--gpus-per-task 1" in out[rank] and "EXATRAIN_SHARE_GPU=1" in out[rank]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_rank_bound_to_one_gpu_uses_it_and_two_ranks_on_it_are_refused():
    code = ("import exatrain as et, torch; m = et.init(et.Plan(data=int(__import__('os')"
            ".environ['WORLD_SIZE']))); print('device', m.device, torch.cuda.device_count())")
    port = str(free_port())
    base = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}
    base.pop("EXATRAIN_SHARE_GPU", None)
    # the scheduler bound this rank (local rank 1 of 2 on the node) to one GPU: it uses it
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env={**base, "RANK": "0", "WORLD_SIZE": "1",
                                             "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert "device cuda:0 1" in alone.stdout, alone.stderr
    # two ranks shown the same GPU: both refuse, naming each other and the fix
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**base, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2"}) for r in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    for rank, err in enumerate(errs):
        assert f"rank {rank} and rank {1 - rank} use the same GPU" in err, err
