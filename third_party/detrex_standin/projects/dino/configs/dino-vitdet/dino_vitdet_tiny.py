# DINO on ViTDet's backbone, shrunk for tests, built as detrex's dino-vitdet configs build it: detectron2's own ViT
# (windowed and global blocks, relative positions, a position embedding pretrained at 224) under detectron2's
# SimpleFeaturePyramid, with dino_tiny's thin transformer (models/dino_thin.py). ViT: 64 wide, 4 blocks (0 and 2
# windowed, window 7), relative positions sized for 256x256 pictures.
from functools import partial

import torch.nn as nn
from detectron2.config import LazyCall as L
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone.fpn import LastLevelMaxPool
from detectron2.modeling.backbone.vit import SimpleFeaturePyramid, ViT

from ..models.dino_thin import dataloader, model, train  # noqa: F401 - read by LazyConfig

model.backbone = L(SimpleFeaturePyramid)(
    net=L(ViT)(img_size=256, patch_size=16, embed_dim=64, depth=4, num_heads=2, drop_path_rate=0.0, window_size=7,
               mlp_ratio=4, qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6), window_block_indexes=[0, 2],
               residual_block_indexes=[], use_rel_pos=True, out_feature="last_feat"),
    in_feature="${.net.out_feature}",
    out_channels=64,
    scale_factors=(2.0, 1.0, 0.5),
    top_block=L(LastLevelMaxPool)(),
    norm="LN",
    square_pad=0,
)
model.neck.input_shapes = {"p3": ShapeSpec(channels=64), "p4": ShapeSpec(channels=64), "p5": ShapeSpec(channels=64)}
model.neck.in_features = ["p3", "p4", "p5"]
