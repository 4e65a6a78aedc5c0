"""Backgrounds and colours shared by the synthetic sets: gradients, smooth noise at a random scale, faint clutter and
sensor noise, so that nothing is found by a flat colour alone."""
from __future__ import annotations

import cv2
import numpy as np


def luma(rgb: np.ndarray) -> np.ndarray:
    return np.asarray(rgb, dtype=np.float64) @ np.array([0.299, 0.587, 0.114])


def background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """(H, W, 3) float32 RGB in [0, 255]."""
    c0, c1 = rng.uniform(0, 255, (2, 3)).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    g = (np.arange(width, dtype=np.float32)[None, :] * np.cos(angle)
         + np.arange(height, dtype=np.float32)[:, None] * np.sin(angle))
    g = ((g - g.min()) / max(float(np.ptp(g)), 1.0))[..., None]
    img = g * (c1 - c0) + c0
    cells = int(rng.integers(2, 40))
    noise = rng.random((cells, cells, 3), dtype=np.float32) - 0.5
    img += cv2.resize(noise, (width, height), interpolation=cv2.INTER_CUBIC) * np.float32(rng.uniform(10, 120))
    clutter = int(rng.integers(0, 12))
    if clutter:  # faint lines and blobs, blended in one go
        layer = img.copy()
        for _ in range(clutter):
            colour = tuple(float(c) for c in rng.uniform(0, 255, 3))
            (x0, x1), (y0, y1) = rng.uniform(0, width, 2).astype(int), rng.uniform(0, height, 2).astype(int)
            if rng.random() < 0.5:
                cv2.line(layer, (x0, y0), (x1, y1), colour, int(rng.integers(1, 6)), cv2.LINE_AA)
            else:
                cv2.circle(layer, (x0, y0), int(rng.uniform(5, min(width, height) / 6)), colour, -1, cv2.LINE_AA)
        alpha = rng.uniform(0.1, 0.35)
        img = cv2.addWeighted(img, 1 - alpha, layer, alpha, 0.0)
    return np.clip(img, 0, 255, out=img)


def finish(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """Sensor noise and sometimes blur, then 8-bit RGB."""
    if rng.random() < 0.3:
        img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.4, 1.0))
    noise = rng.standard_normal(img.shape[:2], dtype=np.float32) * np.float32(rng.uniform(0, 8))
    img = img + noise[..., None] + np.float32(0.5)
    return np.clip(img, 0, 255, out=img).astype(np.uint8)


def contrasting(rng: np.random.Generator, under: np.ndarray, gap: float = 70.0) -> np.ndarray:
    """A random RGB colour whose brightness differs from `under`'s mean by at least `gap`."""
    base = luma(under)
    for _ in range(20):
        colour = rng.uniform(0, 255, 3)
        if abs(luma(colour) - base) >= gap:
            return colour
    return np.clip(np.full(3, 0.0 if base > 127 else 255.0) + rng.uniform(-15, 15, 3), 0, 255)
