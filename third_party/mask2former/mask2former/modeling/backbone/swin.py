"""Mask2Former's Swin backbone, `D2SwinTransformer`, for the stand-in.

Upstream's mask2former/modeling/backbone/swin.py (byte-identical in OneFormer and MaskDINO) is the Swin detection
backbone that detectron2 also ships as detectron2/modeling/backbone/swin.py: the same window partition and reverse,
shifted-window mask, padding, patch merging and patch embedding, line for line. So the stand-in builds detectron2's
copy, with all its export-hostile habits, from upstream's `MODEL.SWIN` keys and names its outputs as upstream does
(res2..res5 for stages 0..3).
"""
from detectron2.modeling import BACKBONE_REGISTRY, ShapeSpec
from detectron2.modeling.backbone.swin import SwinTransformer


@BACKBONE_REGISTRY.register()
class D2SwinTransformer(SwinTransformer):
    def __init__(self, cfg, input_shape):
        s = cfg.MODEL.SWIN
        super().__init__(pretrain_img_size=s.PRETRAIN_IMG_SIZE, patch_size=s.PATCH_SIZE, in_chans=3,
                         embed_dim=s.EMBED_DIM, depths=s.DEPTHS, num_heads=s.NUM_HEADS, window_size=s.WINDOW_SIZE,
                         mlp_ratio=s.MLP_RATIO, qkv_bias=s.QKV_BIAS, qk_scale=s.QK_SCALE, drop_rate=s.DROP_RATE,
                         attn_drop_rate=s.ATTN_DROP_RATE, drop_path_rate=s.DROP_PATH_RATE, ape=s.APE,
                         patch_norm=s.PATCH_NORM, use_checkpoint=s.USE_CHECKPOINT)
        self._names = {f"p{i}": f"res{i + 2}" for i in range(4)}
        self._swin_out_features = list(s.OUT_FEATURES)

    def forward(self, x):
        assert x.dim() == 4, f"SwinTransformer takes an input of shape (N, C, H, W). Got {x.shape} instead!"
        out = {self._names[k]: v for k, v in super().forward(x).items()}
        return {k: v for k, v in out.items() if k in self._swin_out_features}

    def output_shape(self):
        return {name: ShapeSpec(channels=self.embed_dim * 2 ** (int(name[3:]) - 2), stride=2 ** int(name[3:]))
                for name in self._swin_out_features}

    @property
    def size_divisibility(self):
        return 32
