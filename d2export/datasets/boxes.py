"""The synthetic box set: a handful of flat shapes in varied size, aspect, rotation and colour, overlapping one another
and crossed by occluding bars, labelled as COCO instances (boxes and polygon masks of what stays visible)."""
from __future__ import annotations

import cv2
import numpy as np

from d2export.datasets.backgrounds import background, contrasting, finish


def _star(points: int = 5, inner: float = 0.45) -> np.ndarray:
    a = np.pi / 2 + np.arange(2 * points) * np.pi / points
    r = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return np.stack([r * np.cos(a), -r * np.sin(a)], axis=1)


def _regular(sides: int) -> np.ndarray:
    a = np.pi / 2 + np.arange(sides) * 2 * np.pi / sides
    return np.stack([np.cos(a), -np.sin(a)], axis=1)


_ARM = 0.35
# unit outlines, centred at 0 with radius about 1; a class is its outline
SHAPES = {
    "ellipse": _regular(48),
    "triangle": _regular(3),
    "rectangle": np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], np.float64) * 0.8,
    "star": _star(),
    "cross": np.array([[-_ARM, -1], [_ARM, -1], [_ARM, -_ARM], [1, -_ARM], [1, _ARM], [_ARM, _ARM], [_ARM, 1],
                       [-_ARM, 1], [-_ARM, _ARM], [-1, _ARM], [-1, -_ARM], [-_ARM, -_ARM]], np.float64),
}
CATEGORIES = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPES)]
MIN_VISIBLE = 40  # pixels: an object hidden past this is not labelled


def sample(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, list[dict]]:
    """One picture (H, W, 3) uint8 RGB and its instances: {"category_id", "mask"} (mask: what stays visible)."""
    img = background(rng, width, height)
    owner = np.zeros((height, width), np.int32)  # which object each pixel shows (0: none)
    side = min(width, height)
    objects = []
    for k in range(1, int(rng.integers(1, 9)) + 1):
        cid = int(rng.integers(len(SHAPES))) + 1
        radius = rng.uniform(0.04, 0.2) * side
        aspect = rng.uniform(0.6, 1.6)
        angle = rng.uniform(0, 2 * np.pi)
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        outline = (SHAPES[CATEGORIES[cid - 1]["name"]] * radius * [aspect, 1 / aspect]) @ rot.T
        lo, hi = outline.min(axis=0), outline.max(axis=0)
        centre = rng.uniform(-lo + 1, [width - 1, height - 1] - hi)
        pts = np.round((outline + centre) * 16).astype(np.int32)  # 4 fractional bits: cv2's subpixel drawing
        under = img[int(centre[1]), int(centre[0])]
        colour = tuple(float(c) for c in contrasting(rng, under, gap=50))
        cv2.fillPoly(img, [pts], colour, cv2.LINE_AA, shift=4)
        cv2.fillPoly(owner, [pts], k, cv2.LINE_8, shift=4)
        objects.append({"category_id": cid, "owner": k})
    for _ in range(int(rng.random() < 0.4) * int(rng.integers(1, 3))):  # occluding bars, no object's
        (x0, x1), (y0, y1) = rng.uniform(0, width, 2).astype(int), rng.uniform(0, height, 2).astype(int)
        thick = int(rng.uniform(0.02, 0.06) * side)
        colour = tuple(float(c) for c in rng.uniform(0, 255, 3))
        cv2.line(img, (x0, y0), (x1, y1), colour, thick, cv2.LINE_AA)
        cv2.line(owner, (x0, y0), (x1, y1), 0, thick, cv2.LINE_8)
    instances = []
    for obj in objects:
        mask = owner == obj["owner"]
        if mask.sum() >= MIN_VISIBLE:
            instances.append({"category_id": obj["category_id"], "mask": mask})
    return finish(rng, img), instances


def annotation(instance: dict) -> dict | None:
    """An instance as a COCO annotation (without ids): the visible region's outer contours as polygons, its box and
    pixel area; None where no contour of three points remains."""
    mask = instance["mask"].astype(np.uint8)
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    polygons = [c.reshape(-1).astype(float).tolist() for c in contours if len(c) >= 3 and cv2.contourArea(c) > 0]
    if not polygons:
        return None
    ys, xs = np.nonzero(mask)
    x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1
    return {"category_id": instance["category_id"], "iscrowd": 0, "bbox": [x0, y0, x1 - x0, y1 - y0],
            "area": int(mask.sum()), "segmentation": polygons}
