from .convnext import ConvNeXt
from .focalnet import FocalNet

__all__ = ["ConvNeXt", "FocalNet"]
