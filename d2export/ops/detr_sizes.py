"""Size-general rewrites for the AdelaiDet lineage (TESTR, DPText-DETR, DeepSolo) and Deformable-DETR's transformer.

Their code turns feature-map sizes into Python ints and lists; a trace then bakes the dummy input's sizes into the
graph and an export runs wrong, or silently wrong, at other sizes. Each function below computes
the same values as the original from traced tensor sizes instead. Modules are matched by what they have:
- a backbone wrapper with `mask_out_padding` and `feature_strides`;
- an encoder with a static `get_reference_points(spatial_shapes, valid_ratios, device)`;
- a transformer with `gen_encoder_output_proposals` and `enc_output_norm` (box proposals, as TESTR and DPText-DETR;
  Bezier proposals where it has DeepSolo's `bezier_coord_embed`); MaskDINO's free function of that name.
Every function is exact against the original on every size (tests/test_adet_family.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from d2export.ops.level_shapes import level_shapes, level_starts, size_tensor


def mask_out_padding(self, feature_shapes, image_sizes, device):
    """Padding masks per level: True where row ≥ ceil(h / stride) or col ≥ ceil(w / stride) — from tensors."""
    if isinstance(image_sizes, Tensor):
        sizes = image_sizes.to(device=device, dtype=torch.long)
    else:
        sizes = torch.stack([torch.stack([size_tensor(h), size_tensor(w)]) for h, w in image_sizes]).to(device)
    masks = []
    for stride, shape in zip(self.feature_strides, feature_shapes):
        _, _, height, width = shape
        valid = torch.div(sizes + (stride - 1), stride, rounding_mode="floor")  # ceil(size / stride), integer-exact
        rows = torch.arange(height, device=device)[None, :, None] >= valid[:, 0, None, None]
        cols = torch.arange(width, device=device)[None, None, :] >= valid[:, 1, None, None]
        masks.append(rows | cols)
    return masks




def _centres(n, dtype, device) -> Tensor:
    """0.5, 1.5, …, n − 0.5 (linspace(0.5, n − 0.5, n) exactly, without turning n into an int)."""
    return torch.arange(n, dtype=dtype, device=device) + 0.5


def get_reference_points(spatial_shapes, valid_ratios, device):
    refs = []
    for lvl, (h, w) in enumerate(level_shapes(spatial_shapes)):
        ref_y, ref_x = torch.meshgrid(_centres(h, torch.float32, device), _centres(w, torch.float32, device),
                                      indexing="ij")
        ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, lvl, 1] * h)
        ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, lvl, 0] * w)
        refs.append(torch.stack((ref_x, ref_y), -1))
    return torch.cat(refs, 1)[:, :, None] * valid_ratios[:, None]


def gen_encoder_output_proposals(self, memory, memory_padding_mask, spatial_shapes):
    out, proposals = encoder_proposals(memory, memory_padding_mask, spatial_shapes,
                                       bezier=getattr(self, "bezier_coord_embed", None) is not None)
    return self.enc_output_norm(self.enc_output(out)), proposals


def encoder_proposals(memory, memory_padding_mask, spatial_shapes, bezier: bool = False):
    """The two-stage proposals (a box, or DeepSolo's Bezier shrunk to the centre, at each token) and the memory with
    padded and invalid tokens zeroed, as Deformable-DETR's free function `gen_encoder_output_proposals` returns them."""
    n = memory.shape[0]
    proposals = []
    shapes = level_shapes(spatial_shapes)
    for lvl, ((h, w), start) in enumerate(zip(shapes, level_starts(shapes))):
        mask = memory_padding_mask[:, start:start + h * w].view(n, h, w, 1)
        valid_h = torch.sum(~mask[:, :, 0, 0], 1)
        valid_w = torch.sum(~mask[:, 0, :, 0], 1)
        grid_y, grid_x = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=memory.device),
                                        torch.arange(w, dtype=torch.float32, device=memory.device), indexing="ij")
        grid = torch.cat([grid_x.unsqueeze(-1), grid_y.unsqueeze(-1)], -1)
        scale = torch.cat([valid_w.unsqueeze(-1), valid_h.unsqueeze(-1)], 1).view(n, 1, 1, 2)
        grid = (grid.unsqueeze(0).expand(n, -1, -1, -1) + 0.5) / scale
        if bezier:  # DeepSolo: a cubic Bezier shrunk to the centre
            proposals.append(grid.repeat(1, 1, 1, 4).view(n, -1, 8))
        else:  # a box 0.05 · 2^level wide
            wh = torch.ones_like(grid) * 0.05 * (2.0 ** lvl)
            proposals.append(torch.cat((grid, wh), -1).view(n, -1, 4))
    proposals = torch.cat(proposals, 1)
    valid = ((proposals > 0.01) & (proposals < 0.99)).all(-1, keepdim=True)
    proposals = torch.log(proposals / (1 - proposals))
    proposals = proposals.masked_fill(memory_padding_mask.unsqueeze(-1), float("inf"))
    proposals = proposals.masked_fill(~valid, float("inf"))
    return memory.masked_fill(memory_padding_mask.unsqueeze(-1), 0.0).masked_fill(~valid, 0.0), proposals


def has_mask_out_padding(module) -> bool:
    return callable(getattr(module, "mask_out_padding", None)) and hasattr(module, "feature_strides")


def has_reference_points(module) -> bool:
    """An encoder (AdelaiDet) or a whole transformer (detrex) with the static `get_reference_points`."""
    return callable(getattr(type(module), "get_reference_points", None)) and (hasattr(module, "layers")
                                                                              or hasattr(module, "encoder"))


def has_encoder_proposals(module) -> bool:
    return callable(getattr(module, "gen_encoder_output_proposals", None)) and hasattr(module, "enc_output_norm")
