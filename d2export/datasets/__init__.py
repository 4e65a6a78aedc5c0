"""Labelled synthetic data the project makes itself (nothing is downloaded): a text set in AdelaiDet's
TotalText-style COCO JSON and a box set in plain COCO JSON (`d2export synth text|boxes`), and `register()` for
detectron2's catalogs. Drawing needs numpy, Pillow and OpenCV; registering imports detectron2 when called."""
from __future__ import annotations

from d2export.datasets.catalog import register
from d2export.datasets.synth import KINDS, draw, generate

__all__ = ["KINDS", "draw", "generate", "register"]
