"""The fused MSDA kernel behind d2export's custom onnxruntime operator (see `custom_ops`), compiled by numba.

One pass per (image, query): for every head, level and point, the four bilinear corners' D-vectors are read straight
from `value` and accumulated with bilinear × attention weight into the output row. Nothing is materialised between
the inputs and the output, so memory traffic is value (once, cache-resident at TESTR sizes), the locations and
weights, and the output. Exact bilinear with zero padding and align_corners=False, as the CUDA op of Deformable-DETR.
"""
from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _msda(value, s, heads, dim, shapes, starts, loc, attn, lq, levels, points, out):  # pragma: no cover
    # value [N * S, M * D], loc [N * Lq * M * L * P * 2], attn [N * Lq * M * L * P], out [N * Lq, M * D].
    # Operands are indexed by scalars (an array view inside prange costs an atomic reference count per view, which
    # serialises the threads); each query accumulates into its own float32 row, which the compiler vectorises along
    # D. Coordinates are float64: float32 pixel positions drift at large levels.
    for job in numba.prange(out.shape[0]):
        base_in = (job // lq) * s
        acc = np.zeros(heads * dim, np.float32)
        for h in range(heads):
            col = h * dim
            for lv in range(levels):
                height, width, start = shapes[lv, 0], shapes[lv, 1], starts[lv]
                for p in range(points):
                    i = ((job * heads + h) * levels + lv) * points + p
                    x = loc[2 * i] * width - 0.5
                    y = loc[2 * i + 1] * height - 0.5
                    if not (x > -1.0 and y > -1.0 and x < width and y < height):
                        continue  # every corner in the zero padding (or NaN): contributes nothing
                    a = attn[i]
                    fx0, fy0 = math.floor(x), math.floor(y)
                    x0, y0 = int(fx0), int(fy0)
                    wx1, wy1 = x - fx0, y - fy0
                    wx0, wy0 = 1.0 - wx1, 1.0 - wy1
                    # A corner outside the level weighs 0 and reads a clamped (valid) pixel: no branch per corner,
                    # which keeps the loop over D one straight vectorised line (1.4x faster than branching).
                    if x0 < 0:
                        wx0 = 0.0
                    if x0 + 1 >= width:
                        wx1 = 0.0
                    if y0 < 0:
                        wy0 = 0.0
                    if y0 + 1 >= height:
                        wy1 = 0.0
                    wy0, wy1 = wy0 * a, wy1 * a
                    w00, w01 = np.float32(wy0 * wx0), np.float32(wy0 * wx1)
                    w10, w11 = np.float32(wy1 * wx0), np.float32(wy1 * wx1)
                    top = base_in + start + max(y0, 0) * width
                    bottom = base_in + start + min(y0 + 1, height - 1) * width
                    left, right = max(x0, 0), min(x0 + 1, width - 1)
                    r00, r01, r10, r11 = top + left, top + right, bottom + left, bottom + right
                    for k in range(dim):
                        c = col + k
                        acc[c] += (w00 * value[r00, c] + w01 * value[r01, c]) + (w10 * value[r10, c] + w11 * value[r11, c])
        for k in range(heads * dim):
            out[job, k] = acc[k]


def msda(value: np.ndarray, spatial_shapes: np.ndarray, level_start_index: np.ndarray,
         sampling_locations: np.ndarray, attention_weights: np.ndarray) -> np.ndarray:
    """value [N, S, M, D], spatial_shapes [L, 2] (H, W), level_start_index [L], sampling_locations
    [N, Lq, M, L, P, 2] normalised (x, y), attention_weights [N, Lq, M, L, P]  ->  [N, Lq, M * D] float32."""
    value = np.ascontiguousarray(value, dtype=np.float32)
    loc = np.ascontiguousarray(sampling_locations, dtype=np.float32)
    attn = np.ascontiguousarray(attention_weights, dtype=np.float32)
    shapes = np.ascontiguousarray(spatial_shapes, dtype=np.int64)
    starts = np.ascontiguousarray(level_start_index, dtype=np.int64)
    n, _, heads, dim = value.shape
    if loc.ndim != 6 or loc.shape[-1] != 2 or loc.shape[0] != n or loc.shape[2] != heads or attn.shape != loc.shape[:-1]:
        raise ValueError(f"MSDA: sampling_locations {loc.shape} / attention_weights {attn.shape} do not match "
                         f"value {value.shape} ([N, Lq, M, L, P, 2] / [N, Lq, M, L, P] expected)")
    if shapes.shape != (loc.shape[3], 2) or starts.shape != (loc.shape[3],):
        raise ValueError(f"MSDA: spatial_shapes {shapes.shape} / level_start_index {starts.shape} do not match "
                         f"{loc.shape[3]} levels")
    if (starts < 0).any() or (starts + shapes[:, 0] * shapes[:, 1] > value.shape[1]).any():
        raise ValueError(f"MSDA: the levels {shapes.tolist()} need more tokens than value has ({value.shape[1]})")
    lq, levels, points = loc.shape[1], loc.shape[3], loc.shape[4]
    out = np.empty((n * lq, heads * dim), np.float32)
    _msda(value.reshape(-1, heads * dim), value.shape[1], heads, dim, shapes, starts, loc.reshape(-1),
          attn.reshape(-1), lq, levels, points, out)
    return out.reshape(n, lq, heads * dim)
