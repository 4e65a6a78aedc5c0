"""detectron2's PanopticFPN: Mask R-CNN detections plus a semantic segmentation of "stuff".

Recognised by a GeneralizedRCNN-style `inference(..., do_postprocess=)` beside a `sem_seg_head`; with
do_postprocess=False that inference returns (detections, semantic logits) per image, which the rcnn family cannot
flatten. Graph: the rcnn family's outputs (d2export/tracing/rcnn.py) plus `sem_seg` [1, C, H, W], the semantic
logits cropped to the input image (C = stuff classes + 1 "things" class, 0). Serving: the detections as the rcnn
family's, then the "stuff" regions as detectron2's combine_semantic_and_instance_outputs finds them (semantic logits
resized bilinearly to the picture, argmax, minus the confident things' masks, small regions dropped), as Instances
with `stuff=True`.
"""
from __future__ import annotations

import numpy as np

from d2export.families import AdapterOptions
from d2export.families._detections import Detectron2Detections, dataset_metadata, detection_postprocess
from d2export.families._mask_resize import resize_bilinear
from d2export.families.rcnn import has_rcnn_inference
from d2export.instances import Instance, decode_mask, encode_mask


def inference(model, inputs: list) -> dict:
    """PanopticFPN.inference without post-processing: raw detections, and semantic logits cropped to the image."""
    from d2export.tracing.rcnn import instance_tensors

    detections, sem_seg = model.inference(inputs, do_postprocess=False)
    h, w = inputs[0]["image"].shape[-2:]
    return instance_tensors(detections[0]) | {"sem_seg": sem_seg[0][:, :h, :w]}


class PanopticFPN(Detectron2Detections):
    name = "panoptic_fpn"
    summary = "detectron2 PanopticFPN: Mask R-CNN detections and semantic logits"
    priority = 85

    def missing(self, model):
        return has_rcnn_inference(model) or (None if hasattr(model, "sem_seg_head") else "needs a sem_seg_head")

    def adapter(self, model, d2cfg, options: AdapterOptions):
        from d2export.tracing.rcnn import RCNNAdapter

        return RCNNAdapter(model, options.example[0], inference, axes={"sem_seg": {2: "height", 3: "width"}})

    def postprocess(self, d2cfg):
        combine = d2cfg.MODEL.PANOPTIC_FPN.COMBINE
        meta = dataset_metadata(d2cfg)
        return detection_postprocess(d2cfg, d2cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST) | {
            "sem_seg": "semantic logits [N, C, H, W] in input pixels; class 0 is 'things'",
            "stuff_classes": list(getattr(meta, "stuff_classes", None) or []),
            "combine": {"enabled": bool(combine.ENABLED), "overlap_threshold": float(combine.OVERLAP_THRESH),
                        "stuff_area_threshold": int(combine.STUFF_AREA_LIMIT),
                        "instances_score_threshold": float(combine.INSTANCES_CONFIDENCE_THRESH)}}

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        things = super().instances(outputs, index, input_hw, original_hw, post, threshold)
        return things + stuff_regions(outputs["sem_seg"][index], things, original_hw, post)


def stuff_regions(logits: np.ndarray, things: list[Instance], original_hw: tuple[int, int],
                  post: dict) -> list[Instance]:
    """detectron2's combine_semantic_and_instance_outputs, the stuff half: what the semantic argmax labels outside
    the confident things' masks, per class, where large enough."""
    combine, names = post["combine"], post.get("stuff_classes") or []
    semantic = resize_bilinear(logits, original_hw).argmax(0)  # [H', W']
    taken = np.zeros(original_hw, bool)
    for inst in sorted(things, key=lambda i: -i.score):
        if inst.score < combine["instances_score_threshold"]:
            break
        mask = decode_mask(inst.mask)
        if mask.any() and (mask & taken).sum() / mask.sum() <= combine["overlap_threshold"]:
            taken |= mask
    regions = []
    for label in np.unique(semantic):
        mask = (semantic == label) & ~taken
        if label == 0 or mask.sum() < combine["stuff_area_threshold"]:  # 0: the "things" class
            continue
        regions.append(Instance(score=1.0, label=int(label), class_name=names[label] if label < len(names) else None,
                                mask=encode_mask(mask), stuff=True))
    return regions


FAMILY = PanopticFPN()
