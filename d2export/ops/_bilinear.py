"""Bilinear sampling as one Gather and one MatMul, using only ops that opset 11 and TensorRT handle well.

Shared by the MSDA `gather` sampler and `bilinear_grid_sample`. Two ideas make it fast and exact:

- A 2×2 window per sample: its top-left pixel (x0, y0) is clamped so the whole window lies inside the image, and
  each of the window's pixels p gets the tent weight max(0, 1 - |x - p|) along each axis. Inside the image that is
  ordinary bilinear interpolation; a sample outside gives the pixels it would not touch weight 0 — exactly zero
  padding, with no index ever out of range and no mask per corner. Border padding is the same after clamping x.
- A "quad table": row t of an image holds pixels t, t+1, t+W, t+W+1 side by side, so one index fetches a whole
  window (one 4C-wide row instead of four C-wide ones: a quarter of the indices and of the Gather's row overhead).
"""
from __future__ import annotations

import torch

PADDING_MODES = ("zeros", "border")


def _window_1d(coord: torch.Tensor, size: torch.Tensor, padding_mode: str):
    """Window start (float, in [0, max(size - 2, 0)]) and the tent weights of its two pixels along one axis."""
    if padding_mode == "border":
        coord = torch.minimum(coord.clamp_min(0.0), size - 1)
    start = torch.minimum(coord.floor(), size - 2).clamp_min(0.0)
    near = torch.relu(1 - (coord - start).abs())
    # A 1-pixel-wide image has no second pixel: its slot reads a neighbour, which must weigh nothing.
    far = torch.relu(1 - (coord - start - 1).abs()) * (start + 1 < size).to(coord.dtype)
    return start, near, far


def bilinear_window(x: torch.Tensor, y: torch.Tensor, width: torch.Tensor, height: torch.Tensor,
                    padding_mode: str = "zeros", scale: torch.Tensor | None = None,
                    index_dtype: torch.dtype = torch.int32):
    """The 2×2 window of bilinear sampling at pixel coordinates (x, y), pixel centres at integers.

    x, y: floating tensors of one shape; width, height: floating tensors broadcastable to it; `scale`, if given,
    multiplies the weights (e.g. attention weights, folded in here at a quarter of the cost of doing it later).
    Returns (offset, weight): `offset` (x's shape, index_dtype) is the row-major position y0 * width + x0 of the
    window's top-left pixel, always a valid pixel; `weight` (x's shape + [4]) weighs the pixels
    (x0, y0), (x0 + 1, y0), (x0, y0 + 1), (x0 + 1, y0 + 1) — the order of `quad_table`'s slots.
    """
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
    x0, near_x, far_x = _window_1d(x, width, padding_mode)
    y0, near_y, far_y = _window_1d(y, height, padding_mode)
    if scale is not None:
        near_y, far_y = near_y * scale, far_y * scale
    # Four same-shape products stacked: onnxruntime broadcasts an outer product [..., 2, 1] * [..., 1, 2] ~7x slower.
    weight = torch.stack([near_y * near_x, near_y * far_x, far_y * near_x, far_y * far_x], -1)
    # Integer arithmetic for the offset: float32 counts exactly only up to 2**24 pixels.
    offset = y0.to(index_dtype) * width.to(index_dtype) + x0.to(index_dtype)
    return offset, weight


def _shift(rows: torch.Tensor, k) -> torch.Tensor:
    """rows shifted up by k along dim 1, wrapping around (k may be a traced 0-d tensor)."""
    return torch.cat([rows[:, k:], rows[:, :k]], 1)


def quad_table(pixels: torch.Tensor, width) -> torch.Tensor:
    """pixels [B, H*W, ..., C] row-major  ->  [B, H*W, ..., 4C]: row t holds pixels t, t+1, t+W, t+W+1.

    Wrapped-around entries (right column, bottom row) are only ever read by window slots that weigh nothing.
    """
    return torch.cat([pixels, _shift(pixels, 1), _shift(pixels, width), _shift(pixels, width + 1)], -1)
