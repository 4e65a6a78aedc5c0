"""Bilinear and nearest resizing of masks and maps as detectron2 and torch do them, numpy only: separable taps per
output, F.interpolate's weights bit for bit (mask post-processing's resizes, PanopticFPN's semantic logits)."""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

_RESIZE_CHUNK = 1 << 20  # float32 elements a resize step holds per map group: small enough to stay in cache


# Bilinear resizes as a few taps per output along each axis, gathered with np.take: the cost is the output's size
# whatever the scale, single-threaded like torch's own CPU kernel and about as fast (Q=100 masks to 800x1088: 0.5 s;
# 150 class maps 512x683 to 1024x1366: 2 s). Banded weight matrices through BLAS cost 2·span multiply-adds per output
# and, as thousands of small threaded matmuls, stall 10-100x on busy cores.
Taps = tuple  # (index [out, k], weight [out, k]): output i = Σ_j weight[i, j] · input[index[i, j]]


@functools.lru_cache(maxsize=256)
def _taps(size: int, out: int, keep: int | None = None) -> Taps | None:
    """The two taps per output of F.interpolate(mode="bilinear", align_corners=False) from `size` to `out` samples
    along one axis (the first `keep` outputs only, where given); None for the identity."""
    if size == out and keep in (None, out):
        return None
    # torch's own arithmetic (aten's area_pixel_compute_source_index and guard_index_and_lambda): a float32 scale,
    # the source index as one fused multiply-add rounded once to float32 (exact in float64 before that rounding), so
    # the weights are torch's bit for bit; plain float32 steps put them up to 4e-6 off
    scale = np.float64(np.float32(size) / np.float32(out))
    src = np.maximum(scale * (np.arange(out)[:keep] + 0.5) - 0.5, 0).astype(np.float32)
    lo = np.minimum(np.floor(src).astype(np.int64), size - 1)
    frac = np.clip(src - lo.astype(np.float32), 0, 1).astype(np.float32)
    hi = np.where(lo < size - 1, lo + 1, lo)
    return _frozen(np.stack([lo, hi], 1), np.stack([np.float32(1) - frac, frac], 1))


@functools.lru_cache(maxsize=256)
def _then(size: int, out: int, keep: int, after: int) -> Taps | None:
    """Resizing `size` → `out`, keeping the first `keep` outputs and resizing those to `after`, as one set of taps
    (at most four per output: two of two): the large intermediate is never made. Equal to the two steps to float
    rounding."""
    first = _taps(size, out, keep)
    second = _taps(keep, after)
    if first is None or second is None:
        return first or second
    dense = _dense(second, keep).astype(np.float64) @ _dense(first, size).astype(np.float64)  # [after, size]
    k = max(int(np.count_nonzero(dense, 1).max()), 1)
    # each output's inputs are consecutive: a window of k from the first, kept inside the axis
    start = np.minimum(np.argmax(dense != 0, 1), size - k)
    index = start[:, None] + np.arange(k)
    return _frozen(index, np.take_along_axis(dense, index, 1).astype(np.float32))


def _frozen(index: np.ndarray, weight: np.ndarray) -> Taps:
    for a in (index, weight):
        a.flags.writeable = False  # cached: shared by every caller
    return index, weight


def _dense(taps: Taps | None, size: int) -> np.ndarray:
    if taps is None:
        return np.eye(size, dtype=np.float32)
    index, weight = taps
    w = np.zeros((len(index), size), np.float32)
    np.add.at(w, (np.arange(len(index))[:, None], index), weight)
    return w


def resize_weights(size: int, out: int) -> np.ndarray:
    """[out, size] float32 weights of F.interpolate(mode="bilinear", align_corners=False) along one axis."""
    return _dense(_taps(int(size), int(out)), int(size))


def _along(x: np.ndarray, taps: Taps | None, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    if taps is None:
        if out is not None:
            out[...] = x
        return x if out is None else out
    index, weight = taps
    shape = (-1, 1) if axis == -2 else (-1,)
    out = np.take(x, index[:, 0], axis=axis, out=out)
    out *= weight[:, 0].reshape(shape)
    for j in range(1, index.shape[1]):
        other = np.take(x, index[:, j], axis=axis)
        other *= weight[:, j].reshape(shape)
        out += other
    return out


def _resize(x: np.ndarray, steps: Sequence[tuple[Taps | None, Taps | None]]) -> np.ndarray:
    """x [..., h, w] → float32 [..., H, W] through resizes in turn, each (row taps, column taps), columns first as
    torch does; a few maps at a time, so only the output is ever whole in memory."""
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1, *x.shape[-2:])
    sizes = [flat.shape[-2:]]
    for rows, cols in steps:
        sizes.append((sizes[-1][0] if rows is None else len(rows[0]), sizes[-1][1] if cols is None else len(cols[0])))
    out = np.empty((len(flat), *sizes[-1]), np.float32)
    step = max(1, _RESIZE_CHUNK // max(h * w for h, w in sizes))
    for i in range(0, len(flat), step):
        part = flat[i : i + step]
        for j, (rows, cols) in enumerate(steps):
            last = j == len(steps) - 1  # written straight into the output
            part = _along(_along(part, cols, -1), rows, -2, out[i : i + step] if last else None)
    return out.reshape(*x.shape[:-2], *out.shape[-2:])


def resize_bilinear(x: np.ndarray, out_hw: Sequence[int]) -> np.ndarray:
    """x [..., h, w] → float32 [..., H, W]: F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False)."""
    (h, w), (oh, ow) = x.shape[-2:], map(int, out_hw)
    return _resize(x, [(_taps(h, oh), _taps(w, ow))])


def sem_seg_postprocess(result: np.ndarray, img_size: Sequence[int], output_height: int,
                        output_width: int) -> np.ndarray:
    """detectron2's sem_seg_postprocess: [C, Hp, Wp] cropped to `img_size` (h, w), resized bilinearly to the output
    size."""
    h, w = map(int, img_size)
    return resize_bilinear(np.asarray(result)[..., :h, :w], (output_height, output_width))


def _nearest(ids: np.ndarray, crop_hw: Sequence[int], out_hw: Sequence[int]) -> np.ndarray:
    """[.., Hp, Wp] → cropped to `crop_hw`, resized to `out_hw` as F.interpolate(mode="nearest") picks pixels."""
    def index(size: int, out: int) -> np.ndarray:
        scale = np.float32(size) / np.float32(out)
        return np.minimum(np.floor(np.arange(out, dtype=np.float32) * scale).astype(np.int64), size - 1)

    (h, w), (oh, ow) = map(int, crop_hw), map(int, out_hw)
    return ids[..., index(h, oh)[:, None], index(w, ow)[None, :]]
