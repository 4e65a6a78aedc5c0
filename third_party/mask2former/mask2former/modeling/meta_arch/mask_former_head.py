"""`MaskFormerHead`: the sem-seg head of MaskFormer models, a pixel decoder followed by a transformer decoder."""
import logging
from typing import Dict

from torch import nn

from detectron2.config import configurable
from detectron2.layers import ShapeSpec
from detectron2.modeling import SEM_SEG_HEADS_REGISTRY

from ..pixel_decoder.fpn import build_pixel_decoder
from ..transformer_decoder.maskformer_transformer_decoder import build_transformer_decoder


@SEM_SEG_HEADS_REGISTRY.register()
class MaskFormerHead(nn.Module):
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # before version 2 the pixel decoder's weights sat directly under the head. As upstream, a state dict
        # without version metadata (a plain dict) counts as old: its non-predictor head keys get moved too
        if (local_metadata.get("version", None) or 0) < 2:
            moved = [k for k in state_dict if "sem_seg_head" in k and not k.startswith(prefix + "predictor")]
            for k in moved:
                state_dict[k.replace(prefix, prefix + "pixel_decoder.")] = state_dict.pop(k)
            if moved:
                logging.getLogger(__name__).warning(
                    f"Weight format of {type(self).__name__} have changed! Applying automatic conversion now ...")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @configurable
    def __init__(
        self,
        input_shape: Dict[str, ShapeSpec],
        *,
        num_classes: int,
        pixel_decoder: nn.Module,
        loss_weight: float = 1.0,
        ignore_value: int = -1,
        transformer_predictor: nn.Module,
        transformer_in_feature: str,
    ):
        super().__init__()
        input_shape = sorted(input_shape.items(), key=lambda kv: kv[1].stride)
        self.in_features = [k for k, _ in input_shape]
        self.ignore_value = ignore_value
        self.common_stride = 4
        self.loss_weight = loss_weight
        self.pixel_decoder = pixel_decoder
        self.predictor = transformer_predictor
        self.transformer_in_feature = transformer_in_feature
        self.num_classes = num_classes

    @classmethod
    def from_config(cls, cfg, input_shape: Dict[str, ShapeSpec]):
        in_feature = cfg.MODEL.MASK_FORMER.TRANSFORMER_IN_FEATURE
        # channels the transformer decoder receives
        if in_feature in ("transformer_encoder", "multi_scale_pixel_decoder"):
            predictor_in_channels = cfg.MODEL.SEM_SEG_HEAD.CONVS_DIM
        elif in_feature == "pixel_embedding":
            predictor_in_channels = cfg.MODEL.SEM_SEG_HEAD.MASK_DIM
        else:
            predictor_in_channels = input_shape[in_feature].channels
        return {
            "input_shape": {k: v for k, v in input_shape.items() if k in cfg.MODEL.SEM_SEG_HEAD.IN_FEATURES},
            "ignore_value": cfg.MODEL.SEM_SEG_HEAD.IGNORE_VALUE,
            "num_classes": cfg.MODEL.SEM_SEG_HEAD.NUM_CLASSES,
            "pixel_decoder": build_pixel_decoder(cfg, input_shape),
            "loss_weight": cfg.MODEL.SEM_SEG_HEAD.LOSS_WEIGHT,
            "transformer_in_feature": in_feature,
            "transformer_predictor": build_transformer_decoder(cfg, predictor_in_channels, mask_classification=True),
        }

    def forward(self, features, mask=None):
        return self.layers(features, mask)

    def layers(self, features, mask=None):
        mask_features, transformer_encoder_features, multi_scale_features = \
            self.pixel_decoder.forward_features(features)
        if self.transformer_in_feature == "multi_scale_pixel_decoder":
            return self.predictor(multi_scale_features, mask_features, mask)
        if self.transformer_in_feature == "transformer_encoder":
            assert transformer_encoder_features is not None, "Please use the TransformerEncoderPixelDecoder."
            return self.predictor(transformer_encoder_features, mask_features, mask)
        if self.transformer_in_feature == "pixel_embedding":
            return self.predictor(mask_features, mask_features, mask)
        return self.predictor(features[self.transformer_in_feature], mask_features, mask)
