from .transformer_detector import TransformerPureDetector

__all__ = ["TransformerPureDetector"]
