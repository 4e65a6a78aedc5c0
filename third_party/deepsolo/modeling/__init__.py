from .text_spotter import TransformerPureDetector

__all__ = ["TransformerPureDetector"]
from .dn_spotter import DNTextSpotter  # noqa: E402,F401  (registers DNTextSpotter)
