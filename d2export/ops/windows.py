"""Window attention's size arithmetic, from traced sizes.

Swin-style backbones pad a feature map to a multiple of the window, attend within windows (shifted every other
block, with a mask that keeps the rolled-in regions apart), and crop back. Their code builds the shift mask with
`np.ceil` and Python slices, reads the batch as `int(windows / windows per image)`, and decides the padding and the
crop with Python `if`s: a trace bakes the dummy's window count and batch. Everything here takes sizes as they come
while exporting (0-d tensors under the TorchScript tracer, SymInts under torch.export, ints eagerly) and computes
what the original computes, exactly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def ceil_to(size, multiple: int):
    """The smallest multiple of `multiple` >= size, in integer arithmetic on whatever `size` is."""
    return (size + multiple - 1) // multiple * multiple


def pad_bottom_right(x: Tensor, multiple: int | tuple[int, int], channels_last: bool = True) -> Tensor:
    """x ([B, H, W, C], or [B, C, H, W] with channels_last=False) zero-padded at the bottom and right to multiples
    of `multiple` ((rows, columns), or one for both): padded by multiple - 1 (a constant) and cut to the traced
    multiple, so no Python `if` and no size-dependent pad amount enters the graph. Equal to F.pad by the exact
    amounts."""
    mh, mw = (multiple, multiple) if isinstance(multiple, int) else multiple
    if channels_last:
        height, width = x.shape[1], x.shape[2]
        x = F.pad(x, (0, 0, 0, mw - 1, 0, mh - 1))
        return x[:, :ceil_to(height, mh), :ceil_to(width, mw)]
    height, width = x.shape[2], x.shape[3]
    x = F.pad(x, (0, mw - 1, 0, mh - 1))
    return x[:, :, :ceil_to(height, mh), :ceil_to(width, mw)]


def partition(x: Tensor, window: int) -> Tensor:
    """[B, Hp, Wp, C] -> [B * windows, window, window, C], windows in row-major order (Swin's window_partition)."""
    b, hp, wp, c = x.shape
    x = x.reshape(b, hp // window, window, wp // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window, window, c)


def reverse(windows: Tensor, window: int, height, width) -> Tensor:
    """partition's inverse, the batch counted from the windows in integer arithmetic (Swin's and ViTAEv2's
    window_reverse read it back as int(windows / windows per image): a baked batch)."""
    batch = windows.shape[0] // ((height // window) * (width // window))
    x = windows.reshape(batch, height // window, width // window, window, window, windows.shape[-1])
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(batch, height, width, windows.shape[-1])


def shift_mask(height, width, window: int, shift: int, device) -> Tensor:
    """The shifted-window attention mask [windows, window², window²] of a map padded to height x width: 0 between
    tokens of one region, -100 between regions (Swin's constant). Rows (and columns) fall in three regions, those
    before the last window, the last window's first `window - shift`, and the last `shift`: a region index is the
    number of those bounds a row has passed."""
    def regions(n):
        at = torch.arange(n, device=device)
        return (at >= n - window).to(torch.int64) + (at >= n - shift).to(torch.int64)

    ids = regions(height)[:, None] * 3 + regions(width)[None, :]  # [Hp, Wp]
    ids = partition(ids[None, :, :, None], window).reshape(-1, window * window)
    differ = ids[:, None, :] != ids[:, :, None]
    return torch.zeros_like(differ, dtype=torch.float32).masked_fill(differ, -100.0)


def relative_position_table(rel_pos: Tensor, size) -> Tensor:
    """ViTDet's decomposed relative positions for self-attention over `size` tokens along one axis: the table
    [2·size − 1, C] resized linearly to 2·size − 1 rows (the identity where it has them already), indexed by
    query − key + size − 1 (upstream's get_rel_pos with equal query and key sizes)."""
    rows = 2 * size - 1
    table = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1), size=rows, mode="linear")
    table = table.reshape(-1, rows).permute(1, 0)
    at = torch.arange(size, device=rel_pos.device)
    return table[at[:, None] - at[None, :] + (size - 1)]


def resized_position_embedding(abs_pos: Tensor, has_cls_token: bool, height, width) -> Tensor:
    """ViTDet's absolute position embedding [1, S, C] (a square grid, after a class token where it has one) resized
    bicubically to height x width, [1, H, W, C]: always resized, the identity at the grid's own size."""
    if has_cls_token:
        abs_pos = abs_pos[:, 1:]
    side = math.isqrt(abs_pos.shape[1])
    assert side * side == abs_pos.shape[1]
    grid = abs_pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    return F.interpolate(grid, size=(height, width), mode="bicubic", align_corners=False).permute(0, 2, 3, 1)
