from .deformable_transformer import DeformableTransformer
from .ms_deform_attn import MSDeformAttn
from .pos_encoding import PositionalEncoding2D

__all__ = ["DeformableTransformer", "MSDeformAttn", "PositionalEncoding2D"]
