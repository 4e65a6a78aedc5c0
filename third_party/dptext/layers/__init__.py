from .deformable_transformer import DeformableTransformer_Det
from .ms_deform_attn import MSDeformAttn
from .pos_encoding import PositionalEncoding2D

__all__ = ["DeformableTransformer_Det", "MSDeformAttn", "PositionalEncoding2D"]
