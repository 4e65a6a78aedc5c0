"""Multi-scale deformable attention: the autograd wrapper over the compiled op, and the pure-PyTorch reference.

As in Mask2Former's `pixel_decoder/ops/functions/ms_deform_attn_func.py`, the compiled extension (built by
`ops/make.sh`, installed as the top-level module `MultiScaleDeformableAttention`) is imported when this module
is, and a missing build is an import error: nothing in `mask2former` imports on a machine without it.
"""
import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable

try:
    import MultiScaleDeformableAttention as MSDA
except ModuleNotFoundError:
    raise ModuleNotFoundError(
        "\n\nThe MultiScaleDeformableAttention op is not built. Build it with:\n"
        "\tcd mask2former/modeling/pixel_decoder/ops\n\tsh make.sh\n"
    )


class MSDeformAttnFunction(Function):
    @staticmethod
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                im2col_step):
        ctx.im2col_step = im2col_step
        output = MSDA.ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                                             sampling_locations, attention_weights, ctx.im2col_step)
        ctx.save_for_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                              attention_weights)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        value, shapes, start_index, sampling_locations, attention_weights = ctx.saved_tensors
        grad_value, grad_sampling_loc, grad_attn_weight = MSDA.ms_deform_attn_backward(
            value, shapes, start_index, sampling_locations, attention_weights, grad_output, ctx.im2col_step)
        return grad_value, None, None, grad_sampling_loc, grad_attn_weight, None


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    """Reference implementation with one `grid_sample` per level.

    value (N, S, M, D), value_spatial_shapes (L, 2) of (H, W), sampling_locations (N, Lq, M, L, P, 2) in [0, 1],
    attention_weights (N, Lq, M, L, P) -> (N, Lq, M * D).
    """
    N_, S_, M_, D_ = value.shape
    _, Lq_, M_, L_, P_, _ = sampling_locations.shape
    per_level = value.split([H_ * W_ for H_, W_ in value_spatial_shapes], dim=1)
    grids = 2 * sampling_locations - 1  # grid_sample wants [-1, 1]
    sampled = []
    for lid_, (H_, W_) in enumerate(value_spatial_shapes):
        # (N, HW, M, D) -> (N * M, D, H, W)
        value_l_ = per_level[lid_].flatten(2).transpose(1, 2).reshape(N_ * M_, D_, H_, W_)
        # (N, Lq, M, P, 2) -> (N * M, Lq, P, 2)
        grid_l_ = grids[:, :, :, lid_].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(value_l_, grid_l_, mode="bilinear", padding_mode="zeros", align_corners=False))
    # (N, Lq, M, L, P) -> (N * M, 1, Lq, L * P)
    weights = attention_weights.transpose(1, 2).reshape(N_ * M_, 1, Lq_, L_ * P_)
    output = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(N_, M_ * D_, Lq_)
    return output.transpose(1, 2).contiguous()
