"""exatrain: train scientific deep-learning models at any scale, every parallelism on one mesh.

    import exatrain as et
    plan = et.Plan(data=2)
    mesh = et.init(plan)
    model = et.parallelize(et.models.CosmoFlow(size=32), mesh)
"""

from typing import TYPE_CHECKING

import gc as _gc

# importing exatrain (torch with it) makes over a million objects and none is garbage: the
# collector is paused while they come (1.45 s -> 1.2 s of CPU, 2026-11-29) and left as it was
_collecting = _gc.isenabled()
_gc.disable()
try:
    from . import data, models
    # every error of the user's making, to catch as one class (et.UserError) or by its kind
    from .comm.inject import InjectError
    from .data.graph import GraphFileError
    from .data.loader import LoaderTimeout
    from .data.stage import StagingError
    from .errors import (ArgumentError, DataError, LossError, MissingFileError, ModelCodeError,
                         ModelInputError, ModelOptionError, ParallelizeError, SpatialSplitError,
                         TensorSplitError, UserError)
    from .launch.env import LaunchError
    from .mesh import Mesh, init
    from .models.branches import Branches
    from .parallel import parallelize
    from .plan import Plan, PlanError
    from .train import Config, ConfigError, NonFiniteLoss, Trainer, load_config
    from .parallel.data import UnusedParameterError
    from .parallel.pipe.split import PipeSplitError
    from .train.checkpoints.checkpoint import CheckpointError
    from .train.checkpoints.export import InitFromError, load_weights
    from .train.fit import fit, launch
    from .optim.kfac import KFAC, KFACSettings
    from .infer.predict import PredictError, predict
    from .train.job import ResumeError
    from .train.resilience.replicas import ReplicaGroupError
    from .workloads.metrics import Mean, Ratio
    from .workloads.user import Task
    from .version import __version__
finally:
    if _collecting:
        _gc.enable()
    del _collecting, _gc

if TYPE_CHECKING:  # plans()'s annotations name torch's types
    import torch


def plans(model: "torch.nn.Module", example: "torch.Tensor | None" = None,
          **options: object) -> list[dict]:
    """Every valid Plan for your own `model`, ranked by predicted step time, with its predicted
    memory per rank.

    Args:
        model: your `nn.Module`; it is traced once on fake tensors, never trained.
        example: one batch of the model's inputs, or give `sample_shape=` (one sample's shape).
        options: `world` (ranks, required), `batch` (the global batch, required), `loss`
            (a function of the output, to trace backward through), `system` (a system file of
            `exatrain plan`, default "cpu-local"), `precision`, `optimizer`, and `refused=True`
            to also return the Plans that cannot run, with the reason.

    Returns:
        One dict per valid Plan, fastest predicted step first: `plan`, `step_s`,
        `memory_per_rank` (bytes by kind and `total`), and how they were predicted. The planner
        is imported when this is called, so that `import exatrain` stays light
        ([choosing axes](../tutorials/does-not-fit.md)).
    """
    from .tune.user import plans as predict_plans
    return predict_plans(model, example, **options)


__all__ = ["Branches", "Config", "KFAC", "KFACSettings", "Mean", "Mesh", "Plan", "Ratio", "Task",
           "Trainer", "fit", "data", "init", "launch", "load_config", "models", "parallelize",
           "load_weights", "plans", "predict",
           # errors of the user's making (exatrain.errors): the base, then each kind
           "UserError", "ArgumentError", "CheckpointError", "ConfigError", "DataError",
           "GraphFileError", "InitFromError", "InjectError", "LaunchError", "LoaderTimeout",
           "LossError", "MissingFileError", "ModelCodeError", "ModelInputError", "ModelOptionError",
           "NonFiniteLoss", "ParallelizeError", "PipeSplitError", "PlanError", "PredictError",
           "ReplicaGroupError", "ResumeError", "SpatialSplitError", "StagingError", "TensorSplitError", "UnusedParameterError"]
