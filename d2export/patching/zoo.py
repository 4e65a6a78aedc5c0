"""Registered export-time patches for detectron2's own model zoo (families rcnn, retinanet, panoptic_fpn)."""
from __future__ import annotations

from d2export.ops import keypoints
from d2export.patching.registry import register_patch

register_patch("keypoints-from-heatmaps", function="detectron2.modeling.roi_heads.keypoint_head.heatmaps_to_keypoints",
               why="detectron2's scripted ROI loop indexes a tensor of unknown rank: aten::index fails to export",
               )(keypoints.heatmaps_to_keypoints)
