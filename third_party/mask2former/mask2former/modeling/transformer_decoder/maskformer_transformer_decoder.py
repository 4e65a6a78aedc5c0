"""Where Mask2Former keeps the transformer-decoder registry and its builder.

Upstream's file also defines `StandardTransformerDecoder` (the MaskFormer v1 decoder); the stand-in leaves it out.
"""
from detectron2.utils.registry import Registry

TRANSFORMER_DECODER_REGISTRY = Registry("TRANSFORMER_MODULE")
TRANSFORMER_DECODER_REGISTRY.__doc__ = """Transformer decoders of MaskFormer heads, chosen by
cfg.MODEL.MASK_FORMER.TRANSFORMER_DECODER_NAME and called as (cfg, in_channels, mask_classification)."""


def build_transformer_decoder(cfg, in_channels, mask_classification=True):
    name = cfg.MODEL.MASK_FORMER.TRANSFORMER_DECODER_NAME
    return TRANSFORMER_DECODER_REGISTRY.get(name)(cfg, in_channels, mask_classification)
