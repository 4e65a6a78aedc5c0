import math

import torch

from testr.modeling.testr.models import MLP  # noqa: F401  (upstream's MLP is TESTR's)


def gen_point_pos_embed(pts_tensor, d_model, temp):
    """Sine embedding of (bs, nq, n_pts, 2) points in [0, 1] → (bs, nq, n_pts, d_model): half per axis."""
    scale = 2 * math.pi
    dim = d_model // 2
    dim_t = torch.arange(dim, dtype=torch.float32, device=pts_tensor.device)
    dim_t = temp ** (2 * torch.div(dim_t, 2, rounding_mode="trunc") / dim)
    pos_x = (pts_tensor[:, :, :, 0] * scale)[:, :, :, None] / dim_t
    pos_y = (pts_tensor[:, :, :, 1] * scale)[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_x, pos_y), dim=-1)
