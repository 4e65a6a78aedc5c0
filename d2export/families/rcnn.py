"""detectron2's own meta-architectures (GeneralizedRCNN, …) through detectron2's TracingAdapter.

Recognised as the general fallback: any detectron2 model with an `inference(batched_inputs, do_postprocess=)`.
Input `image` [3, H, W] float in the model's pixel format, one image; outputs are the fields of the raw (not
rescaled) Instances in sorted order, then `image_size` (see d2export/tracing/rcnn.py).
"""
from __future__ import annotations

import inspect

from d2export.families import AdapterOptions, Family


class RCNN(Family):
    name = "rcnn"
    summary = "detectron2 R-CNN models through detectron2's TracingAdapter"
    priority = 90

    def missing(self, model):
        inference = getattr(model, "inference", None)
        if not callable(inference) or "do_postprocess" not in inspect.signature(inference).parameters:
            return "needs detectron2's inference(batched_inputs, do_postprocess=...) (GeneralizedRCNN's)"
        return None

    def adapter(self, model, cfg, options: AdapterOptions):
        from d2export.tracing.rcnn import RCNNAdapter

        return RCNNAdapter(model, options.example[0])

    def postprocess(self, cfg):
        return {"score_threshold": float(cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST)}


FAMILY = RCNN()
