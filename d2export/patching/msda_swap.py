"""Re-point multi-scale deformable attention modules (recognised in `ops/msda_modules.py`) at d2export's traceable
core.

Two call conventions exist in the field:
- Deformable-DETR / TESTR / DPText-DETR / DeepSolo `MSDeformAttn.forward(query, reference_points, input_flatten,
  input_spatial_shapes, input_level_start_index, input_padding_mask=None)`;
- mmcv / detrex `MultiScaleDeformableAttention.forward(query, key=None, value=None, identity=None, query_pos=None,
  key_padding_mask=None, reference_points=None, spatial_shapes=None, level_start_index=None, **kwargs)`.
The swap keeps every parameter (only `forward` changes) and is undone by `restore`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d2export.ops.level_shapes import static_size
from d2export.ops.msda import multi_scale_deformable_attention
from d2export.ops.msda_modules import convention, counts, is_msda


def sample(module: nn.Module, query, reference_points, value, spatial_shapes, level_start_index, padding_mask):
    """The shared body: projections, sampling locations, the core. `value`/`query` are [N, len, C]."""
    heads, levels, points = counts(module)
    n, len_q, _ = query.shape
    len_in = value.shape[1]
    value = module.value_proj(value)
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(n, len_in, heads, -1)
    offsets = module.sampling_offsets(query).view(n, len_q, heads, levels, points, 2)
    weights = module.attention_weights(query).view(n, len_q, heads, levels * points)
    weights = F.softmax(weights, -1).view(n, len_q, heads, levels, points)
    corners = static_size(reference_points.shape[-1])  # 2: points, 4: boxes; the model's structure, not the input's
    if corners == 2:
        # offsets are in pixels of each level. The step and the reference points are shaped so that onnxruntime
        # broadcasts on its fast path: trailing [L, P, 2] operands, full-shape references (7% of a 640² image).
        size = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1).to(offsets.dtype)  # (W, H) [L, 2]
        step = size[:, None, :].expand(levels, points, 2)
        ref = reference_points[:, :, None, :, None, :].expand(n, len_q, heads, levels, points, 2)
        locations = ref + offsets / step
    elif corners == 4:
        locations = (reference_points[:, :, None, :, None, :2]
                     + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
    else:
        raise ValueError(f"reference_points must end in 2 or 4, got {tuple(reference_points.shape)}")
    out = multi_scale_deformable_attention(value, spatial_shapes, level_start_index, locations, weights)
    return module.output_proj(out)


def forward_deformable_detr(self, query, reference_points, input_flatten, input_spatial_shapes,
                            input_level_start_index, input_padding_mask=None):
    # no assert on tensor values here: it would bake the dummy's token count into the trace
    return sample(self, query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index,
                  input_padding_mask)


def forward_mmcv(self, query, key=None, value=None, identity=None, query_pos=None, key_padding_mask=None,
                 reference_points=None, spatial_shapes=None, level_start_index=None, **kwargs):
    value = query if value is None else value
    identity = query if identity is None else identity
    if query_pos is not None:
        query = query + query_pos
    if not getattr(self, "batch_first", False):  # mmcv's default layout is [len, N, C]
        query, value = query.transpose(0, 1), value.transpose(0, 1)
    out = sample(self, query, reference_points, value, spatial_shapes, level_start_index, key_padding_mask)
    if not getattr(self, "batch_first", False):
        out = out.transpose(0, 1)
    dropout = getattr(self, "dropout", None)
    return identity + (dropout(out) if isinstance(dropout, nn.Module) else out)


def forward(self, *args, **kwargs):
    """The replacement forward, for either call convention."""
    impl = forward_mmcv if convention(self) == "mmcv" else forward_deformable_detr
    return impl(self, *args, **kwargs)


def swap(model: nn.Module) -> list[str]:
    """Point every MSDA in `model` at the traceable core, for good (eager use too); returns their module paths."""
    swapped = []
    for name, module in model.named_modules():
        if is_msda(module) and "forward" not in module.__dict__:
            module.forward = forward.__get__(module)
            swapped.append(name)
    return swapped


def restore(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) is forward:
            del module.forward
