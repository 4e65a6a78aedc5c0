"""detectron2's PanopticFPN: Mask R-CNN detections plus a semantic segmentation of "stuff".

Recognised by a GeneralizedRCNN-style `inference(..., do_postprocess=)` beside a `sem_seg_head`; with
do_postprocess=False that inference returns (detections, semantic logits) per image, which the rcnn family cannot
flatten. Graph: the rcnn family's outputs (d2export/tracing/rcnn.py) plus `sem_seg` [1, C, H, W], the semantic
logits cropped to the input image (C = stuff classes + 1 "things" class, 0). Serving: the detections as the rcnn
family's; detectron2's panoptic combination is left to the caller (its parameters are in the manifest).
"""
from __future__ import annotations

from d2export.families import AdapterOptions, Family
from d2export.families._detections import dataset_metadata, detection_instances, detection_postprocess
from d2export.families.rcnn import has_rcnn_inference


def inference(model, inputs: list) -> dict:
    """PanopticFPN.inference without post-processing: raw detections, and semantic logits cropped to the image."""
    from d2export.tracing.rcnn import instance_tensors

    detections, sem_seg = model.inference(inputs, do_postprocess=False)
    h, w = inputs[0]["image"].shape[-2:]
    return instance_tensors(detections[0]) | {"sem_seg": sem_seg[0][:, :h, :w]}


class PanopticFPN(Family):
    name = "panoptic_fpn"
    summary = "detectron2 PanopticFPN: Mask R-CNN detections and semantic logits"
    priority = 85

    def missing(self, model):
        return has_rcnn_inference(model) or (None if hasattr(model, "sem_seg_head") else "needs a sem_seg_head")

    def adapter(self, model, cfg, options: AdapterOptions):
        from d2export.tracing.rcnn import RCNNAdapter, zero_score_thresholds

        zero_score_thresholds(model)
        return RCNNAdapter(model, options.example[0], inference, axes={"sem_seg": {2: "height", 3: "width"}})

    def postprocess(self, cfg):
        combine = cfg.MODEL.PANOPTIC_FPN.COMBINE
        meta = dataset_metadata(cfg)
        return detection_postprocess(cfg, cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST) | {
            "sem_seg": "semantic logits [N, C, H, W] in input pixels; class 0 is 'things'",
            "stuff_classes": list(getattr(meta, "stuff_classes", None) or []),
            "combine": {"enabled": bool(combine.ENABLED), "overlap_threshold": float(combine.OVERLAP_THRESH),
                        "stuff_area_threshold": int(combine.STUFF_AREA_LIMIT),
                        "instances_score_threshold": float(combine.INSTANCES_CONFIDENCE_THRESH)}}

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        return detection_instances(outputs, index, input_hw, original_hw, post, threshold)


FAMILY = PanopticFPN()
