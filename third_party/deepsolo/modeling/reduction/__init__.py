"""A ResNet backbone whose own code runs only at multiples of 32, `build_reduction_resnet_backbone`, registered when
this module is imported (as upstream's `adet.modeling.vitae_v2` is). Written for this project, for tests: it stands
in for DeepSolo's ViTAEv2, whose `ReductionCell` counts the tokens of a strided convolution and asserts
`N == H * W` against the sizes its stages pass down (the input's size floor-divided by the strides), so a picture
that is not a multiple of 32 fails in the model's own code (upstream: 333x313, ReductionCell.py:150).

The backbone is detectron2's ResNet unchanged (same parameters, same state dict); only its forward first makes that
check, on the input, with no parameters of its own.
"""
import torch.nn.functional as F

from detectron2.modeling import BACKBONE_REGISTRY
from detectron2.modeling.backbone.resnet import ResNet, build_resnet_backbone

RATIO = 32  # ViTAEv2's strides' product: 4 * 2 * 2 * 2


def reduction_cell(x, ratio=RATIO):
    """ViTAEv2's ReductionCell check in miniature: tokens of a strided window (padding 1: ceil(H / ratio) rows) against
    the size the stages pass down (H // ratio): equal only where the ratio divides the input's height and width."""
    tokens = F.avg_pool2d(x[:, :1], kernel_size=3, stride=ratio, padding=1).flatten(2).transpose(1, 2)
    B, N, C = tokens.shape
    H, W = x.shape[-2] // ratio, x.shape[-1] // ratio
    assert N == H * W
    return tokens


class ReductionResNet(ResNet):
    def forward(self, x):
        reduction_cell(x, RATIO)
        return super().forward(x)


@BACKBONE_REGISTRY.register()
def build_reduction_resnet_backbone(cfg, input_shape):
    backbone = build_resnet_backbone(cfg, input_shape)
    backbone.__class__ = ReductionResNet  # detectron2's ResNet as built, with the check before its forward
    return backbone
