from .text_spotter import TransformerPureDetector

__all__ = ["TransformerPureDetector"]
