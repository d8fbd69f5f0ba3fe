"""Training: config, the Trainer, schedule, the run entry point, fit (the Python API), K-FAC, the
population's driver; checkpoints/ and resilience/. What a run records and shows is in
exatrain.observe (below), prediction in exatrain.infer (above)."""

from .config import Config, ConfigError, load_config
from .resilience.policies import NonFiniteLoss
from .trainer import Trainer

__all__ = ["Config", "ConfigError", "load_config", "NonFiniteLoss", "Trainer"]
