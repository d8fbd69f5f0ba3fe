"""Where does this process sit in the job?  Rank and rendezvous from the launcher's environment.

Recognised, in this order (the first whose variables are present wins):

  torchrun        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  Slurm (srun)    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST / SLURM_JOB_NODELIST
  LSF (jsrun)     JSM_NAMESPACE_RANK, JSM_NAMESPACE_SIZE, JSM_NAMESPACE_LOCAL_RANK, LSB_MCPU_HOSTS
  flux            FLUX_TASK_RANK, FLUX_JOB_SIZE, FLUX_TASK_LOCAL_ID
  Open MPI        OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
  PMI / PMIx      PMI_RANK, PMI_SIZE (MPICH, Intel MPI, Cray PALS) or PMIX_RANK; MPI_LOCALRANKID

MASTER_ADDR / MASTER_PORT, when set, always win: they are how a user overrides the rendezvous.
Where the launcher names no host (flux, MPI), MASTER_ADDR must be set; the error says how.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from typing import Mapping

from ..errors import UserError

DEFAULT_PORT = 29500


class LaunchError(UserError, RuntimeError):
    """The launcher's environment does not say enough to join the job (rank, world size, the
    address of rank 0), or says it inconsistently.

    What to do: start under torchrun, srun, flux or mpirun, or `exatrain run --nproc N`; or set
    the variables the message names.
    """


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # which launcher we recognised

    def export(self, environ: dict) -> None:
        """Write the torch.distributed env:// variables into `environ`."""
        environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                       LOCAL_RANK=str(self.local_rank),
                       LOCAL_WORLD_SIZE=str(self.local_world_size),
                       MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as "nid[001-003,007],login1" into host names."""
    hosts = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if hi:
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + lo)
    return [h for h in hosts if h]


def _job_port(job_id: str | None) -> int:
    """A port derived from the job id, so concurrent jobs on shared nodes rarely collide."""
    if not job_id:
        return DEFAULT_PORT
    return DEFAULT_PORT + zlib.crc32(job_id.encode()) % 2000


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if env.get(name, "") != "":
            try:
                return int(env[name].split("(")[0])
            except ValueError:
                raise LaunchError(f"{name}={env[name]!r} is not an integer.") from None
    if default is None:
        raise LaunchError(f"none of {', '.join(names)} is set.")
    return default


def _master(env: Mapping[str, str], source: str, default_host: str | None,
            job_id: str | None) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR") or default_host
    if not addr:
        raise LaunchError(
            f"Launched by {source}, which does not name a rendezvous host. Export MASTER_ADDR "
            f"(the hostname of the node running rank 0) and optionally MASTER_PORT, e.g. "
            f"`export MASTER_ADDR=$(hostname)` in the batch script before launching.")
    port = int(env.get("MASTER_PORT") or _job_port(job_id))
    return addr, port


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The LaunchEnv of this process, or None if no launcher is recognised (a plain process)."""
    env = os.environ if environ is None else environ

    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        addr, port = _master(env, "torchrun", "127.0.0.1" if world == 1 else None, None)
        return LaunchEnv(_int(env, "RANK"), world, _int(env, "LOCAL_RANK", default=0),
                         _int(env, "LOCAL_WORLD_SIZE", default=world), addr, port, "torchrun")

    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", default=len(nodes) or 1)
        job = env.get("SLURM_JOB_ID")
        addr, port = _master(env, "Slurm", nodes[0] if nodes else None, job)
        return LaunchEnv(_int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", default=0),
                         _int(env, "SLURM_NTASKS_PER_NODE", default=max(1, world // nnodes)),
                         addr, port, "Slurm")

    if "JSM_NAMESPACE_RANK" in env:
        world = _int(env, "JSM_NAMESPACE_SIZE")
        # LSB_MCPU_HOSTS is "launch 1 host1 42 host2 42 ...": the first host is the launch node
        words = env.get("LSB_MCPU_HOSTS", "").split()
        hosts = words[2::2] if len(words) > 2 else words[0::2]
        addr, port = _master(env, "LSF jsrun", hosts[0] if hosts else None, env.get("LSB_JOBID"))
        return LaunchEnv(_int(env, "JSM_NAMESPACE_RANK"), world,
                         _int(env, "JSM_NAMESPACE_LOCAL_RANK", default=0),
                         _int(env, "JSM_NAMESPACE_LOCAL_SIZE", default=world), addr, port, "LSF jsrun")

    if "FLUX_TASK_RANK" in env:
        world = _int(env, "FLUX_JOB_SIZE")
        addr, port = _master(env, "flux", None, env.get("FLUX_JOB_ID"))
        nnodes = _int(env, "FLUX_JOB_NNODES", default=1)
        return LaunchEnv(_int(env, "FLUX_TASK_RANK"), world, _int(env, "FLUX_TASK_LOCAL_ID", default=0),
                         max(1, world // nnodes), addr, port, "flux")

    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        addr, port = _master(env, "Open MPI", None, env.get("OMPI_MCA_orte_ess_jobid"))
        return LaunchEnv(_int(env, "OMPI_COMM_WORLD_RANK"), world,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=world), addr, port, "Open MPI")

    if "PMI_RANK" in env or "PMIX_RANK" in env:
        world = _int(env, "PMI_SIZE", "PMIX_SIZE", "MPI_NRANKS", "WORLD_SIZE")
        addr, port = _master(env, "PMI", None, env.get("PBS_JOBID"))
        return LaunchEnv(_int(env, "PMI_RANK", "PMIX_RANK"), world,
                         _int(env, "MPI_LOCALRANKID", "PALS_LOCAL_RANKID", default=0),
                         _int(env, "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", default=world),
                         addr, port, "PMI")
    return None
