"""Where Mask2Former keeps `build_pixel_decoder` (upstream's file also has the FPN `BasePixelDecoder` and
`TransformerEncoderPixelDecoder`, which the stand-in leaves out)."""
from detectron2.modeling import SEM_SEG_HEADS_REGISTRY


def build_pixel_decoder(cfg, input_shape):
    """The SEM_SEG_HEADS_REGISTRY entry named by cfg.MODEL.SEM_SEG_HEAD.PIXEL_DECODER_NAME; it must have
    `forward_features`."""
    name = cfg.MODEL.SEM_SEG_HEAD.PIXEL_DECODER_NAME
    model = SEM_SEG_HEADS_REGISTRY.get(name)(cfg, input_shape)
    if not callable(getattr(model, "forward_features", None)):
        raise ValueError(f"Only SEM_SEG_HEADS with forward_features method can be used as pixel decoder; {name} "
                         "has none.")
    return model
