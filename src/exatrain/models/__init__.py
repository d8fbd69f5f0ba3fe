"""Plain PyTorch models of the field's benchmark workloads; they know nothing of parallelism."""

from .branches import Branches
from .cosmoflow import CosmoFlow
from .deepcam import DeepCAM
from .gpt import GPT, GPTConfig
from .vit import ViTForecaster

__all__ = ["Branches", "CosmoFlow", "DeepCAM", "GPT", "GPTConfig", "ViTForecaster"]
