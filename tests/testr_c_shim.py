"""TEST-ONLY stand-in for TESTR's compiled attention module ``testr._C`` (d2export's import hook provides the
real replacement). Sampling is a plain per-level F.grid_sample loop; there is no backward."""
import sys
import types

import torch.nn.functional as F


def ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                           attention_weights, im2col_step):
    """value (N, S, M, D), sampling_locations (N, Lq, M, L, P, 2) in [0, 1], attention_weights (N, Lq, M, L, P)
    -> (N, Lq, M * D)."""
    n, _, m, d = value.shape
    _, lq, _, levels, p, _ = sampling_locations.shape
    out = value.new_zeros(n, m, d, lq)
    for lvl in range(levels):
        h, w = (int(s) for s in value_spatial_shapes[lvl])
        start = int(value_level_start_index[lvl])
        # (N, H*W, M, D) -> (N*M, D, H, W)
        v = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(n * m, d, h, w)
        # (N, Lq, M, P, 2) in [0, 1] -> (N*M, Lq, P, 2) in [-1, 1]
        grid = sampling_locations[:, :, :, lvl].transpose(1, 2).reshape(n * m, lq, p, 2) * 2 - 1
        sampled = F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        weights = attention_weights[:, :, :, lvl].transpose(1, 2).reshape(n * m, 1, lq, p)
        out += (sampled * weights).sum(-1).view(n, m, d, lq)
    return out.view(n, m * d, lq).transpose(1, 2).contiguous()


def ms_deform_attn_backward(*args):
    raise NotImplementedError("the test shim of testr._C has no backward")


def install():
    """Puts the shim at sys.modules['testr._C'] unless something (d2export's hook) already provides it."""
    if "testr._C" not in sys.modules:
        shim = types.ModuleType("testr._C")
        shim.ms_deform_attn_forward = ms_deform_attn_forward
        shim.ms_deform_attn_backward = ms_deform_attn_backward
        sys.modules["testr._C"] = shim
    return sys.modules["testr._C"]
