"""exatrain: train scientific deep-learning models at any scale, every parallelism on one mesh.

    import exatrain as et
    plan = et.Plan(data=2)
    mesh = et.init(plan)
    model = et.parallelize(et.models.CosmoFlow(size=32), mesh)
"""

from . import models
from .mesh import Mesh, init
from .parallel import parallelize
from .plan import Plan, PlanError
from .train import Config, ConfigError, NonFiniteLoss, Trainer, load_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Mesh", "NonFiniteLoss", "Plan", "PlanError", "Trainer",
           "init", "load_config", "models", "parallelize"]
