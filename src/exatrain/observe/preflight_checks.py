"""What a run needs before it starts, checked on every rank (part of `exatrain preflight`).

Each rank reports its facts (host, versions, devices, free memory, what it sees of the data path
and the run directory); rank 0 compares them. The run directory check is real: rank 0 writes a
marker file under `run.out_dir` and every rank must see it (a node that mounts a different or
no parallel file system fails here, not at the first checkpoint).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from ..comm import broadcast_object


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or the host's available memory (CPU ranks)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def rank_facts(mesh, config, min_free_gib: float) -> dict:
    """Collective (one broadcast): this rank's facts, including whether it sees rank 0's marker."""
    from ..version import __version__

    out_dir = Path(config.run.out_dir)
    marker = None
    if mesh.rank == 0:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            marker = out_dir / f".preflight-{socket.gethostname()}-{os.getpid()}"
            marker.write_text("exatrain preflight\n")
        except OSError as exc:
            marker = f"error: {exc}"
    marker = broadcast_object(str(marker), mesh.world)
    sees_run_dir = not marker.startswith("error") and Path(marker).is_file()
    data_path = getattr(config.data, "path", "")
    facts = {"rank": mesh.rank, "host": socket.gethostname(), "exatrain": __version__,
             "torch": torch.__version__, "device": str(mesh.device),
             "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
             "local_rank": mesh.local_rank, "free_memory_bytes": free_memory_bytes(mesh.device),
             "min_free_bytes": int(min_free_gib * 2**30), "data_path": str(data_path),
             "sees_data": bool(data_path) and Path(data_path).exists(),
             "sees_run_dir": sees_run_dir, "run_dir_marker": marker}
    mesh.barrier()  # everyone has looked before the marker goes
    if mesh.rank == 0 and not marker.startswith("error"):
        Path(marker).unlink(missing_ok=True)
    return facts


def check_ranks(facts: list[dict], config) -> list[str]:
    """Rank 0: what differs from rank 0 or is missing, one line per problem, naming rank and host."""
    problems = []
    first = facts[0]
    generated = getattr(config.data, "generate", False) and not first["sees_data"]
    for f in facts:
        who = f"rank {f['rank']} ({f['host']})"
        for key in ("exatrain", "torch"):
            if f[key] != first[key]:
                problems.append(f"{who} runs {key} {f[key]}, rank 0 runs {first[key]}: install the "
                                "same environment on every node (see docs/how-to/startup.md)")
        if f["device"].startswith("cuda") and f["local_rank"] >= f["cuda_devices"]:
            problems.append(f"{who} is local rank {f['local_rank']} but sees {f['cuda_devices']} "
                            "GPU(s): start at most one rank per GPU")
        if f["free_memory_bytes"] < f["min_free_bytes"]:
            problems.append(f"{who} has {f['free_memory_bytes'] / 2**30:.2f} GiB free on "
                            f"{f['device']}, less than {f['min_free_bytes'] / 2**30:.2f} GiB: "
                            "another process holds it, or the node is the wrong kind")
        if not f["sees_run_dir"]:
            problems.append(f"{who} does not see run.out_dir={config.run.out_dir} (marker "
                            f"{f['run_dir_marker']}): put it on a file system every node mounts")
        if f["data_path"] and not f["sees_data"] and not generated:
            problems.append(f"{who} does not see data.path={f['data_path']}: stage the data there "
                            "or mount it on every node")
    return problems
