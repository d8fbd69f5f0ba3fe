"""Plain PyTorch models of the field's benchmark workloads; they know nothing of parallelism.

  cosmoflow, deeplab (DeepCAM at MLPerf's definition), deepcam (the small net), vit, gpt, gcn,
  schnet, dimenet (DimeNet++), forces (a learned energy's forces, -dE/dx), branches
  (et.Branches), image_pool (DeepLab's image feature)

Imports: torch only (and the foundations); never a strategy.
"""

from .branches import Branches
from .cosmoflow import CosmoFlow
from .deepcam import DeepCAM
from .deeplab import DeepLabXception
from .dimenet import DimeNetPlusPlus
from .forces import Forces
from .image_pool import ImagePool
from .gpt import GPT, GPTConfig
from .schnet import SchNet
from .vit import ViTForecaster

__all__ = ["Branches", "CosmoFlow", "DeepCAM", "DeepLabXception", "DimeNetPlusPlus", "Forces",
           "GPT", "GPTConfig", "ImagePool", "SchNet", "ViTForecaster"]
