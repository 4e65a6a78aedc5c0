"""Sine position embedding (DETR's, as Mask2Former's `transformer_decoder/position_encoding.py` keeps it)."""
import math

import torch
from torch import nn


class PositionEmbeddingSine(nn.Module):
    """(N, C, H, W) -> (N, 2 * num_pos_feats, H, W): y then x, sin/cos interleaved per frequency.
    With `normalize`, cumulative positions are scaled to (0, scale] over the unmasked extent."""

    def __init__(self, num_pos_feats=64, temperature=10000, normalize=False, scale=None):
        super().__init__()
        if scale is not None and not normalize:
            raise ValueError("normalize should be True if scale is passed")
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * math.pi if scale is None else scale

    def forward(self, x, mask=None):
        if mask is None:
            mask = torch.zeros((x.size(0), x.size(2), x.size(3)), device=x.device, dtype=torch.bool)
        valid = ~mask
        y_embed = valid.cumsum(1, dtype=torch.float32)
        x_embed = valid.cumsum(2, dtype=torch.float32)
        if self.normalize:
            eps = 1e-6
            y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale

        freq = torch.arange(self.num_pos_feats, dtype=torch.float32, device=x.device)
        freq = self.temperature ** (2 * (freq // 2) / self.num_pos_feats)

        def encode(e):
            e = e[:, :, :, None] / freq
            return torch.stack((e[:, :, :, 0::2].sin(), e[:, :, :, 1::2].cos()), dim=4).flatten(3)

        return torch.cat((encode(y_embed), encode(x_embed)), dim=3).permute(0, 3, 1, 2)

    def __repr__(self, _repr_indent=4):
        lines = [f"Positional encoding {type(self).__name__}"] + [
            " " * _repr_indent + f"{k}: {getattr(self, k)}"
            for k in ("num_pos_feats", "temperature", "normalize", "scale")
        ]
        return "\n".join(lines)
