from .dino import DINO
from .dino_transformer import DINOTransformer, DINOTransformerDecoder, DINOTransformerEncoder

__all__ = ["DINO", "DINOTransformer", "DINOTransformerDecoder", "DINOTransformerEncoder"]
