# DINO on FocalNet, shrunk for tests, as detrex's dino-focalnet configs build it (stages p1..p3 into the neck): 32..256
# channels, depths 1/1/2/1, focal level 2 with windows of 3, on dino_tiny's thin transformer (models/dino_thin.py).
from detectron2.config import LazyCall as L
from detectron2.layers import ShapeSpec

from detrex.modeling.backbone import FocalNet

from ..models.dino_thin import dataloader, model, train  # noqa: F401 - read by LazyConfig

model.backbone = L(FocalNet)(embed_dim=32, depths=(1, 1, 2, 1), focal_levels=(2, 2, 2, 2),
                             focal_windows=(3, 3, 3, 3), out_indices=(1, 2, 3))
model.neck.input_shapes = {"p1": ShapeSpec(channels=64), "p2": ShapeSpec(channels=128), "p3": ShapeSpec(channels=256)}
model.neck.in_features = ["p1", "p2", "p3"]
