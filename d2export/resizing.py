"""Image handling shared by exporting and serving: numpy and Pillow only (no torch), so the runtime stays slim."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def resized_shape(h: int, w: int, min_size: int, max_size: int) -> tuple[int, int]:
    """detectron2's test-time ResizeShortestEdge: shortest edge to `min_size`, longest capped at `max_size`."""
    if min_size <= 0:
        return h, w
    scale = min_size / min(h, w)
    nh, nw = h * scale, w * scale
    if max_size > 0 and max(nh, nw) > max_size:
        scale = max_size / max(nh, nw)
        nh, nw = nh * scale, nw * scale
    return int(nh + 0.5), int(nw + 0.5)


def resize_shortest_edge(image: np.ndarray, min_size: int, max_size: int) -> np.ndarray:
    """HWC uint8 → resized HWC uint8, bilinear through Pillow, as detectron2's ResizeTransform does."""
    from PIL import Image

    h, w = image.shape[:2]
    nh, nw = resized_shape(h, w, min_size, max_size)
    if (nh, nw) == (h, w):
        return image
    return np.asarray(Image.fromarray(image).resize((nw, nh), Image.BILINEAR))


def pad_batch(images: Sequence[np.ndarray], fixed: tuple[int, int, int] | None = None,
              minimum: Sequence[int] = (0, 0), divisibility: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """CHW images of any sizes → (images [N, C, Hmax, Wmax] zero-padded bottom/right, image_sizes [N, 2] int64).
    `fixed` (N, H, W): a fixed-size graph's batch and size, padded to it; rows beyond the images are blank, with the
    first image's size (their outputs are not read). `minimum` (H, W): the least size the graph takes, padded up to.
    `divisibility`: Hmax and Wmax then up to its multiples (a model whose own code runs only there), as detectron2's
    ImageList pads to its size_divisibility; image_sizes keep each image's own size."""
    if not images:
        raise ValueError("empty batch")
    n = len(images)
    hmax = max([minimum[0]] + [im.shape[1] for im in images])
    wmax = max([minimum[1]] + [im.shape[2] for im in images])
    if divisibility > 1:
        hmax, wmax = (-(-v // divisibility) * divisibility for v in (hmax, wmax))
    if fixed:
        if n > fixed[0] or hmax > fixed[1] or wmax > fixed[2]:
            raise ValueError(f"{n} picture(s) of up to {hmax}x{wmax} do not fit this graph's fixed batch of "
                             f"{fixed[0]} at {fixed[1]}x{fixed[2]}")
        n, hmax, wmax = fixed
    batch = np.zeros((n, images[0].shape[0], hmax, wmax), dtype=images[0].dtype)
    for i, im in enumerate(images):
        batch[i, :, : im.shape[1], : im.shape[2]] = im
    sizes = np.array([im.shape[1:3] for im in images] + [images[0].shape[1:3]] * (n - len(images)), dtype=np.int64)
    return batch, sizes


def synthetic_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A deterministic CHW uint8 picture with structure (bars, blobs, strokes, noise) for dummy inputs and tests."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.empty((3, h, w), np.float32)
    for c in range(3):
        fy, fx, phase = rng.uniform(0.01, 0.08, 2).tolist() + [rng.uniform(0, 6.28)]
        img[c] = 127 + 60 * np.sin(fy * yy + fx * xx + phase)
    for _ in range(6):  # dark text-like strokes on a light band
        y0, x0 = rng.integers(0, max(h - 8, 1)), rng.integers(0, max(w - 8, 1))
        img[:, y0 : y0 + rng.integers(4, 12), x0 : x0 + rng.integers(20, 80)] = rng.uniform(0, 60)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)
