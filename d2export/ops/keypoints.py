"""detectron2's heatmaps_to_keypoints in a form the ONNX exporter takes.

detectron2 scripts its loop over ROIs (the ROI count is data-dependent), and the loop's advanced indexing
`roi_map_scores[keypoints_idx, y_int, x_int]` fails to export ("aten::index … tensor of unknown rank"). At the
argmax the full-resolution softmax numerator is exp(0) = 1, so the score needs no indexing at all: it is
1 / Σ exp(heatmap − max) over the pooled heatmap — the same value, computed without gathering.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


@torch.jit.script_if_tracing
def heatmaps_to_keypoints(maps: Tensor, rois: Tensor) -> Tensor:
    """(#ROIs, K, Hm, Wm) heatmap logits, (#ROIs, 4) boxes → (#ROIs, K, 4): x, y, logit, score (detectron2's)."""
    widths = (rois[:, 2] - rois[:, 0]).clamp(min=1)
    heights = (rois[:, 3] - rois[:, 1]).clamp(min=1)
    widths_ceil, heights_ceil = widths.ceil(), heights.ceil()
    num_keypoints = maps.shape[1]
    rows = [maps.new_zeros(0, num_keypoints, 4)]
    for i in range(maps.shape[0]):
        size = (int(heights_ceil[i]), int(widths_ceil[i]))
        roi_map = F.interpolate(maps[i : i + 1], size=size, mode="bicubic", align_corners=False)
        row_max, x_in_row = roi_map[0].max(2)  # [K, H]: first maximum of each row
        logit, y_int = row_max.max(1)  # the first row holding it: flattened argmax's tie order
        x_int = x_in_row.gather(1, y_int[:, None])[:, 0]
        score = torch.reciprocal((maps[i] - logit.view(num_keypoints, 1, 1)).exp().sum((1, 2)))
        x = (x_int.float() + 0.5) * (widths[i] / widths_ceil[i]) + rois[i, 0]
        y = (y_int.float() + 0.5) * (heights[i] / heights_ceil[i]) + rois[i, 1]
        rows.append(torch.stack([x, y, logit, score], dim=1)[None])
    return torch.cat(rows, dim=0)
