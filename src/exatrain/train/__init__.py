"""Training: config, Trainer, schedule, checkpoints, resilience, the run entry point, fit (what a
run records and shows is in exatrain.observe)."""

from .config import Config, ConfigError, load_config
from .trainer import NonFiniteLoss, Trainer

__all__ = ["Config", "ConfigError", "load_config", "NonFiniteLoss", "Trainer"]
