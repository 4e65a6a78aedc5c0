"""DeepSolo's Swin backbone, `build_swin_backbone`, for the stand-in: registered when this module is imported, as
upstream's `adet.modeling.swin` is (its train_net.py: `from adet.modeling import swin, vitae_v2`).

Upstream's adet/modeling/swin/swin_transformer.py is the Swin detection backbone that detectron2 also ships
(detectron2/modeling/backbone/swin.py): the same window partition and reverse, shifted-window mask, padding, patch
merging and patch embedding. So the stand-in builds detectron2's copy with upstream's sizes per MODEL.SWIN.TYPE and
names its outputs as upstream does (stage3..stage5 for stages 1..3).
"""
from detectron2.modeling import BACKBONE_REGISTRY, ShapeSpec
from detectron2.modeling.backbone.swin import SwinTransformer as _Swin

SIZES = {"tiny": (2, 2, 6, 2), "small": (2, 2, 18, 2)}  # depths; both embed 96, heads 3/6/12/24, window 7


class SwinTransformer(_Swin):
    def __init__(self, out_features, **kwargs):
        super().__init__(out_indices=tuple(int(name[5:]) - 2 for name in out_features), **kwargs)
        self.out_features = list(out_features)

    def forward(self, x):
        return {f"stage{int(k[1:]) + 2}": v for k, v in super().forward(x).items()}

    def output_shape(self):
        return {name: ShapeSpec(channels=self.embed_dim * 2 ** (int(name[5:]) - 2), stride=2 ** int(name[5:]))
                for name in self.out_features}


@BACKBONE_REGISTRY.register()
def build_swin_backbone(cfg, input_shape):
    swin_type = cfg.MODEL.SWIN.TYPE
    if swin_type not in SIZES:
        raise NotImplementedError(swin_type)
    return SwinTransformer(in_chans=input_shape.channels, embed_dim=96, depths=SIZES[swin_type],
                           num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=cfg.MODEL.SWIN.DROP_PATH_RATE,
                           ape=False, patch_norm=True, frozen_stages=cfg.MODEL.BACKBONE.FREEZE_AT,
                           out_features=["stage3", "stage4", "stage5"])
