from .attention import MultiheadAttention
from .box_ops import box_cxcywh_to_xyxy, box_xyxy_to_cxcywh
from .mlp import FFN, MLP
from .multi_scale_deform_attn import MultiScaleDeformableAttention, multi_scale_deformable_attn_pytorch
from .position_embedding import PositionEmbeddingSine, get_sine_pos_embed
from .transformer import BaseTransformerLayer, TransformerLayerSequence

__all__ = ["MultiheadAttention", "box_cxcywh_to_xyxy", "box_xyxy_to_cxcywh", "FFN", "MLP",
           "MultiScaleDeformableAttention", "multi_scale_deformable_attn_pytorch", "PositionEmbeddingSine",
           "get_sine_pos_embed", "BaseTransformerLayer", "TransformerLayerSequence"]
