"""Launching: recognise the job's launcher, or spawn local ranks.

  env           rank and rendezvous from torchrun, Slurm, Flux, LSF, mpirun, or none
  local         spawn N local ranks (`exatrain run --nproc N`, the test harness)
  batch         ready batch scripts (`--print-batch-script slurm|flux`)
  batch_groups  the Slurm script of a job of replica groups ([fault_tolerance]): a lighthouse,
                a step and a restart loop per group
  lighthouse    torchft's lighthouse as exatrain starts it: the program and its flags
  gpus          which GPU a rank uses, as centres bind them
  signals, teardown, host_memory   early stop signals, an orderly end, freed host memory kept

Imports: the foundations only; it knows no mesh.
"""

from .env import LaunchEnv, LaunchError, detect, expand_nodelist
from .local import spawn

__all__ = ["LaunchEnv", "LaunchError", "detect", "expand_nodelist", "spawn"]
