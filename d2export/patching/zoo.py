"""Registered export-time patches for detectron2's own model zoo (families rcnn, retinanet, panoptic_fpn): the graph takes
one image per run, and these keep what detectron2 does per image size-general."""
from __future__ import annotations

import torch

from d2export.ops import keypoints, rewrites
from d2export.patching.registry import register_patch


@register_patch("keypoints-from-heatmaps",
                function="detectron2.modeling.roi_heads.keypoint_head.heatmaps_to_keypoints",
                why="detectron2's scripted ROI loop indexes a tensor of unknown rank: aten::index fails to export")
def heatmaps_to_keypoints(maps, rois):
    if torch.compiler.is_exporting():  # torch.export runs the loop in Python: it would bake the traced ROI count
        raise RuntimeError("Keypoint R-CNN's heatmaps resize per ROI to sizes read from the boxes' values, which "
                           "torch.export cannot capture (it would unroll the traced ROI count into the graph): "
                           "export it with export.exporter=torchscript")
    return keypoints.heatmaps_to_keypoints(maps, rois)


@register_patch("split-whole", function=("torch.Tensor.split", "torch.split"),
                why="x.split([len(x)]) (detectron2's per-image split of one image's boxes, scores, masks) bakes the "
                    "traced count into the graph: the next picture's count fails in onnxruntime's Split")
def split_whole(tensor, split_size_or_sections, dim=0):
    sections = split_size_or_sections
    if isinstance(sections, (list, tuple)) and len(sections) == 1 and sections[0] == tensor.shape[dim]:
        return (tensor,)  # one section holding everything: the tensor itself, whatever its traced size
    return NotImplemented


@register_patch("bitmask-boxes", function="detectron2.structures.masks.BitMasks.get_bounding_boxes",
                why="a Python loop over the masks (MaskDINO's `INITIALIZE_BOX_TYPE: bitmask`) bakes their count: a "
                    "batch of another size is wrong in onnxruntime")
def bitmask_boxes(self):
    from detectron2.structures import Boxes

    return Boxes(rewrites.mask_boxes(self.tensor))
