"""DCNv3 (InternImage's deformable convolution, as detrex and InternImage call it through `_C.dcnv3_forward`) in
traceable, device-safe PyTorch.

What the compiled op computes, channels last: for each output pixel (i, j), each group g and each of the K = kh·kw
kernel points, a bilinear sample (zero padding, align_corners=False) of the group's channels at

    x = j·stride_w + (dil_w·(kw − 1)) // 2 + 0.5 + (a·dil_w − (dil_w·(kw − 1)) // 2)·s + offset_x·s − pad_w
    y = i·stride_h + (dil_h·(kh − 1)) // 2 + 0.5 + (b·dil_h − (dil_h·(kh − 1)) // 2)·s + offset_y·s − pad_h

(continuous coordinates of the unpadded input, pixel p spanning [p, p + 1); s = offset_scale; kernel points ordered
with a, the column, outer), each weighted by its mask value and summed over the points. offset [N, H_out, W_out,
G·K·2] holds (x, y) per point, mask [N, H_out, W_out, G·K]. Output sizes follow the traced input:
(H + 2·pad − dil·(k − 1) − 1) // stride + 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _axis(size, kernel: int, stride: int, pad: int, dilation: int, device) -> tuple[Tensor, Tensor]:
    """Per axis: the output positions' base coordinate (pixels of the padded input, + 0.5 for the pixel centre) and the
    kernel points' displacements from it."""
    reach = dilation * (kernel - 1)
    out = (size + 2 * pad - reach - 1) // stride + 1
    base = torch.arange(out, device=device).to(torch.float32) * stride + (reach // 2 + 0.5)
    taps = torch.arange(kernel, device=device).to(torch.float32) * dilation - reach // 2
    return base, taps


def dcnv3(input: Tensor, offset: Tensor, mask: Tensor, kernel_h: int, kernel_w: int, stride_h: int, stride_w: int,
          pad_h: int, pad_w: int, dilation_h: int, dilation_w: int, group: int, group_channels: int,
          offset_scale: float) -> Tensor:
    """input [N, H, W, G·C], offset [N, Ho, Wo, G·K·2], mask [N, Ho, Wo, G·K] -> [N, Ho, Wo, G·C]."""
    n, height, width, _ = input.shape
    _, out_h, out_w, _ = offset.shape
    k = kernel_h * kernel_w
    base_y, taps_y = _axis(height, kernel_h, stride_h, pad_h, dilation_h, input.device)
    base_x, taps_x = _axis(width, kernel_w, stride_w, pad_w, dilation_w, input.device)
    # kernel points with the column outer, as the op orders them: point p = a * kh + b
    tap_x = taps_x[:, None].expand(kernel_w, kernel_h).reshape(k)
    tap_y = taps_y[None, :].expand(kernel_w, kernel_h).reshape(k)
    off = offset.reshape(n, out_h, out_w, group, k, 2).to(torch.float32)
    x = base_x[None, None, :, None, None] + tap_x * offset_scale + off[..., 0] * offset_scale - pad_w
    y = base_y[None, :, None, None, None] + tap_y * offset_scale + off[..., 1] * offset_scale - pad_h
    # grid_sample's normalised coordinates over the unpadded input (align_corners=False: pixel p spans [p, p + 1))
    grid = torch.stack((x / width * 2 - 1, y / height * 2 - 1), -1)  # [N, Ho, Wo, G, K, 2]
    grid = grid.permute(0, 3, 1, 2, 4, 5).reshape(n * group, out_h * out_w, k, 2).to(input.dtype)
    value = input.reshape(n, height * width, group, group_channels).permute(0, 2, 3, 1)
    value = value.reshape(n * group, group_channels, height, width)
    sampled = F.grid_sample(value, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    weights = mask.reshape(n, out_h * out_w, group, k).permute(0, 2, 1, 3).reshape(n * group, 1, out_h * out_w, k)
    out = (sampled * weights.to(sampled.dtype)).sum(-1)  # [N·G, C, Ho·Wo]
    return out.reshape(n, group * group_channels, out_h, out_w).permute(0, 2, 3, 1).contiguous()
