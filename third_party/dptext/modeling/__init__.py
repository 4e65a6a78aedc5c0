from .transformer_detector import TransformerPureDetector

__all__ = ["TransformerPureDetector"]
from .srformer import SRFormerDetector  # noqa: E402,F401  (registers SRFormerDetector)
