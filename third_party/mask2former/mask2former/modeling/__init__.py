# as upstream, importing modeling registers the backbone and the heads (upstream also registers BasePixelDecoder and
# the per-pixel baseline heads, which the stand-in leaves out)
from .backbone.swin import D2SwinTransformer
from .pixel_decoder.msdeformattn import MSDeformAttnPixelDecoder
from .meta_arch.mask_former_head import MaskFormerHead
