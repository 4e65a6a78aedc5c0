# as upstream, importing modeling registers the heads (upstream also registers D2SwinTransformer,
# BasePixelDecoder and the per-pixel baseline heads, which the stand-in leaves out)
from .pixel_decoder.msdeformattn import MSDeformAttnPixelDecoder
from .meta_arch.mask_former_head import MaskFormerHead
