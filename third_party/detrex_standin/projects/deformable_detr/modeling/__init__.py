from .deformable_detr import DeformableDETR
from .deformable_transformer import (DeformableDetrTransformer, DeformableDetrTransformerDecoder,
                                     DeformableDetrTransformerEncoder)

__all__ = ["DeformableDETR", "DeformableDetrTransformer", "DeformableDetrTransformerDecoder",
           "DeformableDetrTransformerEncoder"]
