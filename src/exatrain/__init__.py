"""exatrain: train scientific deep-learning models at any scale, every parallelism on one mesh.

    import exatrain as et
    plan = et.Plan(data=2)
    mesh = et.init(plan)
    model = et.parallelize(et.models.CosmoFlow(size=32), mesh)
"""

from . import data, models
from .mesh import Mesh, init
from .models.branches import Branches
from .parallel import parallelize
from .plan import Plan, PlanError
from .train import Config, ConfigError, NonFiniteLoss, Trainer, load_config
from .train.fit import fit, launch
from .train.kfac import KFAC, KFACSettings
from .train.predict import predict
from .tune.user import plan
from .workloads.metrics import Mean, Ratio
from .workloads.user import Task

__version__ = "0.1.0"
__all__ = ["Branches", "Config", "ConfigError", "KFAC", "KFACSettings", "Mean", "Mesh", "NonFiniteLoss", "Plan", "PlanError", "Ratio",
           "Task", "Trainer", "fit", "data", "init", "launch", "load_config", "models", "parallelize", "plan", "predict"]
