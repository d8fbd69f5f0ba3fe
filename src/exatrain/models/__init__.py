"""Plain PyTorch models of the field's benchmark workloads; they know nothing of parallelism."""

from .branches import Branches
from .cosmoflow import CosmoFlow
from .deepcam import DeepCAM
from .deeplab import DeepLabXception
from .image_pool import ImagePool
from .gpt import GPT, GPTConfig
from .vit import ViTForecaster

__all__ = ["Branches", "CosmoFlow", "DeepCAM", "DeepLabXception", "GPT", "GPTConfig", "ImagePool", "ViTForecaster"]
