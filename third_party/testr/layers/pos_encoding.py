"""Sine position encodings: 2-D over (padded) feature maps, 1-D over the character slots."""
import numpy as np
import torch
import torch.nn as nn


class PositionalEncoding1D(nn.Module):
    def __init__(self, num_pos_feats=64, temperature=10000, normalize=False, scale=None):
        """num_pos_feats: the channel count of the tensor the encoding is added to."""
        super().__init__()
        if scale is not None and normalize is False:
            raise ValueError("normalize should be True if scale is passed")
        self.channels = num_pos_feats
        self.scale = 2 * np.pi if scale is None else scale
        self.normalize = normalize
        dim_t = torch.arange(0, self.channels, 2).float()
        # a buffer, so it is part of TESTR's state dict
        self.register_buffer("inv_freq", 1.0 / (temperature ** (dim_t / self.channels)))

    def forward(self, tensor):
        """tensor: (len, c) -> encoding (len, c)."""
        if tensor.ndim != 2:
            raise RuntimeError("The input tensor has to be 2D!")
        length, orig_ch = tensor.shape
        pos_x = torch.arange(1, length + 1, device=tensor.device).type(self.inv_freq.type())
        if self.normalize:
            pos_x = pos_x / (pos_x[-1:] + 1e-6) * self.scale
        sin_inp_x = torch.einsum("i,j->ij", pos_x, self.inv_freq)
        emb_x = torch.cat((sin_inp_x.sin(), sin_inp_x.cos()), dim=-1)
        emb = torch.zeros((length, self.channels), device=tensor.device).type(tensor.type())
        emb[:, : self.channels] = emb_x
        return emb[:, :orig_ch]


class PositionalEncoding2D(nn.Module):
    """DETR's sine encoding over a NestedTensor; positions count only unpadded pixels."""

    def __init__(self, num_pos_feats=64, temperature=10000, normalize=False, scale=None):
        super().__init__()
        if scale is not None and normalize is False:
            raise ValueError("normalize should be True if scale is passed")
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * np.pi if scale is None else scale

    def forward(self, tensors):
        x = tensors.tensors
        mask = tensors.mask
        assert mask is not None
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        if self.normalize:
            eps = 1e-6
            y_embed = (y_embed - 0.5) / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = (x_embed - 0.5) / (x_embed[:, :, -1:] + eps) * self.scale

        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=x.device)
        dim_t = self.temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / self.num_pos_feats)

        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)
