from .transformer_detector import TransformerDetector

__all__ = ["TransformerDetector"]
