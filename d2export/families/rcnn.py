"""detectron2's GeneralizedRCNN (Faster, Mask and Keypoint R-CNN): boxes, scores, labels, and masks and keypoints
where the model has those heads.

Recognised by detectron2's `inference(batched_inputs, do_postprocess=)` returning Instances (PanopticFPN's, which
returns semantic maps beside them, is families/panoptic_fpn.py). Graph: d2export/tracing/rcnn.py (one image per run,
outputs in input pixels, score threshold 0 in the graph, the model's own in the manifest). Serving: d2export/
families/_detections.py (boxes rescaled and clipped as detector_postprocess does, masks pasted there).
"""
from __future__ import annotations

import inspect

from d2export.families import AdapterOptions
from d2export.families._detections import Detectron2Detections, detection_postprocess


def has_rcnn_inference(model) -> str | None:
    inference = getattr(model, "inference", None)
    if not callable(inference) or "do_postprocess" not in inspect.signature(inference).parameters:
        return "needs detectron2's inference(batched_inputs, do_postprocess=...) (GeneralizedRCNN's)"
    return None


class RCNN(Detectron2Detections):
    name = "rcnn"
    summary = "detectron2 R-CNN models (Faster/Mask/Keypoint R-CNN): boxes, masks, keypoints"
    priority = 90

    def missing(self, model):
        if hasattr(model, "sem_seg_head"):
            return "has a semantic segmentation head (a panoptic model)"
        return has_rcnn_inference(model)

    def adapter(self, model, d2cfg, options: AdapterOptions):
        from d2export.tracing.rcnn import RCNNAdapter

        return RCNNAdapter(model, options.example[0])

    def postprocess(self, d2cfg):
        return detection_postprocess(d2cfg, d2cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST)


FAMILY = RCNN()
