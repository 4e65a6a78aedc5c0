"""Serving-side post-processing shared by detectron2's own detectors (families rcnn, retinanet, panoptic_fpn), numpy
only: what detectron2's detector_postprocess does to raw detections for a DefaultPredictor — boxes scaled to the
original picture, clipped, empty ones dropped; per-box mask probabilities pasted into the picture (bilinear, as
paste_masks_in_image's grid_sample, then ≥ mask_threshold) and run-length encoded; keypoints scaled.

Graph outputs (d2export/tracing/rcnn.py), row `index` of: `boxes` [N, R, 4] xyxy and `keypoints` [N, R, K, 3] in
input pixels, `scores`, `labels` [N, R], `masks` [N, R, M, M] probabilities per box. `Detectron2Detections` is
what those families have in common.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from d2export.families import Family
from d2export.instances import Instance, encode_mask

MASKS_DOC = ("per-box MxM probabilities; pasted in the runtime into the original picture as detectron2's "
             "paste_masks_in_image does (bilinear over the box, then >= mask_threshold), run-length encoded")
OUTPUT_DOCS = {
    "boxes": "detections' boxes x0, y0, x1, y1 in input-image pixels",
    "scores": "their scores (every detection the model keeps; the threshold is applied on the host)",
    "labels": "their class indices",
    "masks": MASKS_DOC,
    "keypoints": "keypoints (x, y, score) per detection, in input-image pixels",
    "sem_seg": "semantic segmentation logits over the input image (stuff classes, then 'things' as 0)",
}

OUTPUT_KINDS = {"boxes": "pixels", "scores": "probabilities", "labels": "ids", "masks": "masks",
                "keypoints": "pixels", "sem_seg": "logits"}  # keypoint scores ride with their coordinates


def detection_postprocess(d2cfg, score_threshold: float, num_classes: str = "roi_heads") -> dict[str, Any]:
    """The manifest's post-processing: the model's own score threshold (the graph keeps every score), the mask
    layout, and the test dataset's class and keypoint names where detectron2's metadata knows them (and their count is
    the model's: `num_classes` names the config section saying it)."""
    post: dict[str, Any] = {"score_threshold": float(score_threshold), "mask_threshold": 0.5, "masks": MASKS_DOC}
    meta = dataset_metadata(d2cfg)
    names = list(getattr(meta, "thing_classes", None) or [])
    if names and len(names) == d2cfg.MODEL.get(num_classes.upper()).NUM_CLASSES:
        post["class_names"] = names
    keypoint_names = list(getattr(meta, "keypoint_names", None) or [])
    if d2cfg.MODEL.KEYPOINT_ON and len(keypoint_names) == d2cfg.MODEL.ROI_KEYPOINT_HEAD.NUM_KEYPOINTS:
        post["keypoint_names"] = keypoint_names
    return post


def dataset_metadata(d2cfg):
    """detectron2's metadata of the config's first test dataset (builtin COCO names register on import)."""
    import detectron2.data  # noqa: F401 - registers the builtin datasets' metadata
    from detectron2.data import MetadataCatalog

    return MetadataCatalog.get(d2cfg.DATASETS.TEST[0]) if d2cfg.DATASETS.TEST else None


def detection_instances(outputs: dict[str, np.ndarray], index: int, input_hw: tuple[int, int],
                        original_hw: tuple[int, int], post: dict[str, Any], threshold: float) -> list[Instance]:
    """Scores above `threshold` (>, as detectron2's heads filter), in the original picture's pixels."""
    (h, w), (oh, ow) = input_hw, original_hw
    scale = np.array([ow / w, oh / h])
    keep = np.flatnonzero(outputs["scores"][index] > threshold)
    boxes = outputs["boxes"][index][keep].astype(np.float64) * np.tile(scale, 2)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, ow)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, oh)
    nonempty = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    names = post.get("class_names")
    instances = []
    for k, box in zip(keep[nonempty], boxes[nonempty]):
        label = int(outputs["labels"][index, k])
        inst = Instance(score=float(outputs["scores"][index, k]), label=label, box=box.tolist(),
                        class_name=names[label] if names and 0 <= label < len(names) else None)
        if "masks" in outputs:
            pasted = paste_mask(outputs["masks"][index, k], box, oh, ow) >= post.get("mask_threshold", 0.5)
            inst.mask = encode_mask(pasted)
        if "keypoints" in outputs:
            points = outputs["keypoints"][index, k].astype(np.float64)
            points[:, :2] *= scale
            inst.keypoints = points.tolist()
        instances.append(inst)
    return instances


class Detectron2Detections(Family):
    """detectron2's own detectors: detections sorted by score, documented and post-processed alike."""
    output_docs = OUTPUT_DOCS
    output_kinds = OUTPUT_KINDS
    # box regression (RPN anchors, ROI heads' deltas), keypoint heatmaps' locations
    int8_float_scopes = ("anchor_deltas", "bbox_pred", "bbox_embed")
    sorted_by = "scores"
    # random box deltas throw boxes out of the picture; RetinaNet's classifier tower (std-0.01 convolutions) shrinks
    # every logit to its prior, so all anchors score alike (a thousand near-ties per TopK): its convolutions get a
    # gain of about one and its logits a spread of about one; random keypoint logits in the thousands make
    # detectron2's own decoding assert. A random ResNet's activations grow into the thousands: norms standardised.
    seeded_scales = {"bbox_pred": 0.01, "head.cls_subnet": 3.0, "head.cls_score.weight": 0.5,
                     "keypoint_head.score_lowres": 0.01}
    seeded_norms = True

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        return detection_instances(outputs, index, input_hw, original_hw, post, threshold)


def paste_mask(mask: np.ndarray, box: np.ndarray, height: int, width: int) -> np.ndarray:
    """An MxM probability map over `box` → an HxW map, as detectron2's _do_paste_mask on the CPU: pixel centres within
    a pixel of the box sampled bilinearly (grid_sample, align_corners=False, zeros outside), 0 elsewhere."""
    x0, y0, x1, y1 = box
    out = np.zeros((height, width), np.float32)
    xs = np.arange(max(int(np.floor(x0)) - 1, 0), min(int(np.ceil(x1)) + 1, width))
    ys = np.arange(max(int(np.floor(y0)) - 1, 0), min(int(np.ceil(y1)) + 1, height))
    if len(xs) and len(ys):
        wy = _bilinear_weights((ys + 0.5 - y0) / (y1 - y0), mask.shape[0])
        wx = _bilinear_weights((xs + 0.5 - x0) / (x1 - x0), mask.shape[1])
        out[ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1] = wy @ mask.astype(np.float64) @ wx.T
    return out


def _bilinear_weights(t: np.ndarray, size: int) -> np.ndarray:
    """Positions `t` in box units (0…1 spans the mask) → [len(t), size] linear-interpolation weights over mask cells,
    zero beyond the mask's edge cells (grid_sample's zeros padding, align_corners=False)."""
    u = t * size - 0.5  # grid_sample: ((2t - 1) + 1) * size / 2 - 0.5
    lo = np.floor(u).astype(np.int64)
    frac = u - lo
    weights = np.zeros((len(t), size))
    for idx, wgt in ((lo, 1 - frac), (lo + 1, frac)):
        inside = (idx >= 0) & (idx < size)
        weights[np.flatnonzero(inside), idx[inside]] += wgt[inside]
    return weights
