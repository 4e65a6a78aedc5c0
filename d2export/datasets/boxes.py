"""The synthetic box set: a handful of flat shapes in varied size, aspect, rotation and colour, overlapping one another
and crossed by occluding bars, labelled as COCO instances (boxes and polygon masks of what stays visible) and, on
request, per pixel: the shapes as things, the bars and the background as stuff (semantic and COCO-panoptic labels)."""
from __future__ import annotations

import cv2
import numpy as np

from d2export.datasets.backgrounds import background, contrasting, finish
from d2export.datasets.layout import IGNORE_LABEL


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
# the per-pixel labels' stuff classes, after the shapes (things first: their contiguous ids are the instance set's)
STUFF = [{"id": len(SHAPES) + 1, "name": "bar", "supercategory": "stuff"},
         {"id": len(SHAPES) + 2, "name": "background", "supercategory": "stuff"}]
PANOPTIC_CATEGORIES = [{**c, "isthing": 1} for c in CATEGORIES] + [{**c, "isthing": 0} for c in STUFF]
MIN_VISIBLE = 40  # pixels: an object hidden past this is not labelled (per pixel: void)
_BAR = -1  # the owner of a bar's pixels


def scene(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, list[dict], list[dict]]:
    """One picture (H, W, 3) uint8 RGB, its instances {"category_id", "mask"} (mask: what stays visible) and its stuff
    regions {"category_id", "mask"} (the bars, the background); pixels of objects too hidden to label are in
    neither."""
    img = background(rng, width, height)
    owner = np.zeros((height, width), np.int32)  # which object each pixel shows (0: none, _BAR: a bar)
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
        cv2.line(owner, (x0, y0), (x1, y1), _BAR, thick, cv2.LINE_8)
    instances = []
    for obj in objects:
        mask = owner == obj["owner"]
        if mask.sum() >= MIN_VISIBLE:
            instances.append({"category_id": obj["category_id"], "mask": mask})
    stuff = [{"category_id": c["id"], "mask": owner == value} for c, value in zip(STUFF, (_BAR, 0))]
    return finish(rng, img), instances, stuff


def sample(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, list[dict]]:
    """One picture (H, W, 3) uint8 RGB and its instances: {"category_id", "mask"} (mask: what stays visible)."""
    img, instances, _ = scene(rng, width, height)
    return img, instances


def annotation(instance: dict) -> dict | None:
    """An instance as a COCO annotation (without ids): the visible region's outer contours as polygons, its box and
    pixel area; None where no contour of three points remains."""
    mask = instance["mask"].astype(np.uint8)
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    polygons = [c.reshape(-1).astype(float).tolist() for c in contours if len(c) >= 3 and cv2.contourArea(c) > 0]
    if not polygons:
        return None
    return {"category_id": instance["category_id"], "iscrowd": 0, "bbox": _box(mask), "area": int(mask.sum()),
            "segmentation": polygons}


def _box(mask: np.ndarray) -> list[int]:
    """A mask's COCO box [x, y, w, h] (whole pixels)."""
    ys, xs = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))  # not np.nonzero: a tenth the time
    x0, y0, x1, y1 = int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1
    return [x0, y0, x1 - x0, y1 - y0]


def pixel_labels(instances: list[dict], stuff: list[dict], height: int, width: int) -> tuple[np.ndarray, np.ndarray,
                                                                                           list[dict]]:
    """A picture's per-pixel labels from its labelled instances (those with a COCO annotation: a shape too thin for
    one is void here too) and stuff regions: the semantic map (uint8 contiguous class of PANOPTIC_CATEGORIES, 255
    void), the panoptic id map (int32 segment ids, 0 void) and the segments (COCO panoptic `segments_info`)."""
    contiguous = {c["id"]: i for i, c in enumerate(PANOPTIC_CATEGORIES)}
    semantic = np.full((height, width), IGNORE_LABEL, np.uint8)
    panoptic = np.zeros((height, width), np.int32)
    segments = []
    for region in [*instances, *stuff]:
        mask = region["mask"]
        if not mask.any():
            continue
        sid = len(segments) + 1
        panoptic[mask] = sid
        semantic[mask] = contiguous[region["category_id"]]
        segments.append({"id": sid, "category_id": region["category_id"], "iscrowd": 0, "bbox": _box(mask),
                         "area": int(mask.sum())})
    return semantic, panoptic, segments
