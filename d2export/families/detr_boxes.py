"""DETR box detectors in detrex's form (IDEA-Research/detrex: Deformable-DETR, DINO, DAB/DN-Deformable-DETR, …),
usually configured by a LazyConfig (`model.lazy_config`).

Recognised by what the detector itself has: backbone, neck, position embedding, transformer, per-layer
`class_embed`/`bbox_embed`, `select_box_nums_for_evaluation`, `preprocess_image` and `inference`, with an
`inverse_sigmoid` in its module. The graph (d2export/tracing/detrex.py) outputs, K = select_box_nums_for_evaluation:
- `boxes` [N, K, 4]: x0, y0, x1, y1 in input-image pixels;
- `scores` [N, K]: sigmoid class probabilities, the top K over queries × classes, descending;
- `labels` [N, K]: their class indices
— exactly what the model's own `inference` selects. Serving rescales to the original picture, clips and drops empty
boxes as detectron2's `detector_postprocess` does, thresholds (≥) and names classes from the dataset's metadata.
"""
from __future__ import annotations

import sys
from functools import partial

import numpy as np

from d2export.families import AdapterOptions, Family, lacks
from d2export.instances import Instance

DETECTOR = ("backbone", "neck", "position_embedding", "transformer", "class_embed", "bbox_embed",
            "select_box_nums_for_evaluation", "preprocess_image", "inference")
OUTPUTS = ("boxes", "scores", "labels")
OUTPUT_DOCS = {"boxes": "x0, y0, x1, y1 in input-image pixels",
               "scores": "sigmoid class probabilities, the model's own top K over queries x classes, descending",
               "labels": "their class indices"}
OUTPUT_KINDS = {"boxes": "pixels", "scores": "probabilities", "labels": "ids"}
SCORE_THRESHOLD = 0.5  # detrex's demo default; the graph itself keeps all K


class DetrBoxes(Family):
    name = "detr_boxes"
    summary = "detrex DETR box detectors (Deformable-DETR, DINO, …): top-K boxes, scores, labels"
    priority = 40
    output_docs = OUTPUT_DOCS
    output_kinds = OUTPUT_KINDS
    int8_float_scopes = ("sampling_offsets", "attention_weights", "reference_points", "bbox_embed")
    sorted_by = "scores"

    def missing(self, model):
        missed = lacks(model, DETECTOR, also_self=True)
        if missed is None and not callable(getattr(sys.modules.get(type(model).__module__), "inverse_sigmoid", None)):
            return f"{type(model).__module__} defines no inverse_sigmoid (the box refinement's own)"
        return missed

    def adapter(self, model, d2cfg, options: AdapterOptions):
        from d2export.tracing.detrex import DetrexAdapter, DetrexBody, top_k

        pre = self.preprocess(d2cfg)
        decode = partial(top_k, k=int(model.select_box_nums_for_evaluation))
        return DetrexAdapter(model, DetrexBody(model), decode, OUTPUTS, pre["pixel_mean"], pre["pixel_std"])

    def postprocess(self, d2cfg):
        from d2export import lazyconfig

        names = lazyconfig.class_names(d2cfg) if lazyconfig.is_lazy(d2cfg) else None
        return {"score_threshold": SCORE_THRESHOLD, "boxes": "xyxy, input pixels", "class_names": names or []}

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        (h, w), (oh, ow) = input_hw, original_hw
        boxes = outputs["boxes"][index].astype(np.float64) * [ow / w, oh / h, ow / w, oh / h]
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, ow)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, oh)
        scores, labels = outputs["scores"][index], outputs["labels"][index]
        keep = (scores >= threshold) & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        names = post.get("class_names") or []
        return [Instance(score=float(scores[k]), label=int(labels[k]), box=boxes[k].tolist(),
                         class_name=names[labels[k]] if 0 <= labels[k] < len(names) else None)
                for k in np.flatnonzero(keep)]


FAMILY = DetrBoxes()
