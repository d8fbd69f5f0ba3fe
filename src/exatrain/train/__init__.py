"""Training: config, Trainer, schedule, checkpoints, the run entry point."""

from .config import Config, ConfigError, load_config
from .trainer import NonFiniteLoss, Trainer

__all__ = ["Config", "ConfigError", "load_config", "NonFiniteLoss", "Trainer"]
