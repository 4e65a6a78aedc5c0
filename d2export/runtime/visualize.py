"""A picture of a prediction: masks (translucent), outlines (polygons, boxes, boundaries, centre lines), keypoints and
labels, on the original picture. Generic over `Instance` fields, so every family draws without code of its own. The
regions a served kind declares (d2export/served_kinds/: a segmentation model's panoptic segments, else its semantic
classes) are translucent, each labelled once with its class inside it.

Labels stay inside the picture and are placed, where there is room, where they overlap no other label. The font is
the first found of `D2EXPORT_FONT`, a CJK-capable system font, DejaVu Sans (the `fonts-dejavu-core` package, or
matplotlib's copy) and Pillow's own; a character the font cannot draw (the unknown-character glyph '口' without a CJK
font) is drawn as '□' rather than as an empty box.
"""
from __future__ import annotations

import colorsys
import functools
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from d2export.instances import Instance, Prediction, decode_mask
from d2export.served_kinds import kinds

FONT_CANDIDATES = (  # a CJK font first (custom dictionaries), then DejaVu Sans
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc", "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",
    "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf", "/Library/Fonts/Arial Unicode.ttf",
)
Box = tuple[float, float, float, float]


def _colour(i: int) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.85, 0.95)  # golden-ratio hues: neighbours differ
    return int(r * 255), int(g * 255), int(b * 255)


def _label(inst: Instance, show_scores: bool) -> str:
    name = inst.text if inst.text is not None else (inst.class_name or "")
    return (name + (f" {inst.score:.2f}" if show_scores else "")).strip()


def _outlines(inst: Instance) -> list[tuple[list[tuple[float, float]], bool]]:
    """(points, closed) for everything the instance outlines."""
    shapes = []
    if inst.box is not None:
        x0, y0, x1, y1 = inst.box
        shapes.append(([(x0, y0), (x1, y0), (x1, y1), (x0, y1)], True))
    if inst.boundary:
        shapes.append(([tuple(p[:2]) for p in inst.boundary], True))
    if inst.polygon:
        shapes.append(([tuple(p[:2]) for p in inst.polygon], inst.closed))
    return shapes


def _overlay_masks(image: np.ndarray, instances: list[Instance], alpha: float = 0.45) -> np.ndarray:
    """Each instance's mask blended in its colour (the colour its outline gets)."""
    out = np.ascontiguousarray(image[..., :3] if image.ndim == 3 else np.repeat(image[..., None], 3, 2))
    if any(inst.mask for inst in instances):
        out = out.astype(np.float32)
        for i, inst in enumerate(instances):
            if inst.mask:
                where = decode_mask(inst.mask)
                out[where] = (1 - alpha) * out[where] + alpha * np.array(_colour(i), np.float32)
        out = out.round().astype(np.uint8)
    return out


def _regions(prediction: Prediction, class_names: Sequence[str] | None) -> list[tuple[np.ndarray, tuple, str]]:
    """(mask, colour, label) of each region of the first served kind, by `regions_rank`, that the prediction holds
    (each panoptic segment, or where there is no panoptic map each semantic class), coloured by the key its kind
    gives (a segment's id: things of one class apart; a class's id: the same colour in every picture)."""
    names = list(class_names or [])

    def name(label: int) -> str:
        return names[label] if 0 <= label < len(names) else str(label)

    for kind in sorted((k for k in kinds("picture") if k.regions is not None), key=lambda k: k.regions_rank):
        found = kind.regions(prediction, name)
        if found is not None:
            return [(mask, _colour(key), label) for mask, key, label in found]
    return []


def _overlay_regions(image: np.ndarray, regions: list[tuple[np.ndarray, tuple, str]], alpha: float = 0.4
                     ) -> np.ndarray:
    if not regions:
        return image
    out = image.astype(np.float32)
    for mask, colour, _ in regions:
        out[mask] = (1 - alpha) * out[mask] + alpha * np.array(colour, np.float32)
    return out.round().astype(np.uint8)


def interior_point(mask: np.ndarray, grid: int = 128) -> tuple[float, float] | None:
    """(x, y) deep inside `mask` (where a label sits well): the pixel that survives the most erosions, of those the
    nearest the region's centroid; erosion on a grid of at most `grid` cells a side, for speed. None: empty mask."""
    ys, xs = np.nonzero(mask)
    if not len(ys):
        return None
    step = max(1, -(-max(mask.shape) // grid))
    cells = mask[step // 2 :: step, step // 2 :: step]
    deepest = cells
    while cells.any():
        deepest = cells
        inner = np.zeros_like(cells)  # 4-neighbour erosion, outside the picture counting as outside
        inner[1:-1, 1:-1] = (cells[1:-1, 1:-1] & cells[:-2, 1:-1] & cells[2:, 1:-1] & cells[1:-1, :-2]
                             & cells[1:-1, 2:])
        cells = inner
    cy, cx = ys.mean(), xs.mean()
    if deepest.any():  # on the grid: back to pixels
        ys, xs = np.nonzero(deepest)
        ys, xs = ys * step + step // 2, xs * step + step // 2
    best = np.argmin((ys - cy) ** 2 + (xs - cx) ** 2)
    return float(xs[best]), float(ys[best])


def _font_files() -> list[str]:
    files = [os.environ["D2EXPORT_FONT"]] if os.environ.get("D2EXPORT_FONT") else []
    files += list(FONT_CANDIDATES)
    try:
        import matplotlib

        files.append(str(Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"))
    except ImportError:
        pass
    return [f for f in files if Path(f).is_file()]


@functools.lru_cache(maxsize=16)
def font(size: int):
    """The first usable font at `size` pixels (see the module's docstring)."""
    from PIL import ImageFont

    for path in _font_files():
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        return ImageFont.load_default()


@functools.lru_cache(maxsize=4096)
def _drawable(face, char: str) -> bool:
    """Whether `face` has a glyph for `char` (not its 'missing' box, the glyph of a non-character)."""
    if char.isspace() or ord(char) < 128:
        return True
    def glyph(c: str) -> bytes:
        mask = face.getmask(c)
        return repr(mask.size).encode() + bytes(mask)  # size and pixels of the glyph as drawn

    return glyph(char) != glyph("\uffff")


def displayable(text: str, face) -> str:
    """`text` with the characters `face` cannot draw shown as '□' (or '?' where even that is missing)."""
    stand_in = "□" if _drawable(face, "□") else "?"
    return "".join(c if _drawable(face, c) else stand_in for c in text)


def _overlap(a: Box, b: Box) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def place_labels(anchors: Sequence[Box], sizes: Sequence[tuple[float, float]], width: int, height: int,
                 avoid: Sequence[Box] = ()) -> list[Box]:
    """A box for each label (w, h) near its shape's bounding box `anchors[i]`: above it, below it, inside its top or
    bottom, then stacked further away, each at the shape's left or right; always inside the picture, and the first
    that overlaps no label placed before it nor a box in `avoid` (else the one that overlaps least)."""
    placed: list[Box] = list(avoid)
    for (x0, y0, x1, y1), (w, h) in zip(anchors, sizes):
        w, h = min(w, width), min(h, height)
        rows = [y0 - h, y1, y0, y1 - h] + [y for k in range(1, 8) for y in (y0 - h - k * h, y1 + k * h)]
        candidates = [(x, y) for y in rows for x in (x0, x1 - w, x1, x0 - w)]
        best, best_cost = None, None
        for x, y in candidates:
            x, y = min(max(x, 0), width - w), min(max(y, 0), height - h)  # inside the picture
            box = (x, y, x + w, y + h)
            cost = sum(_overlap(box, other) for other in placed)
            if best_cost is None or cost < best_cost:
                best, best_cost = box, cost
            if cost == 0:
                break
        placed.append(best)
    return placed[len(avoid):]


def draw_prediction(image: np.ndarray, prediction: Prediction, show_scores: bool = True, title: str | None = None,
                    class_names: Sequence[str] | None = None):
    """HWC uint8 RGB + its prediction → a PIL image (save it as PNG). `class_names`: the model's, for semantic classes
    (panoptic segments and instances carry their own)."""
    from PIL import Image, ImageDraw

    image = np.asarray(image)
    regions = _regions(prediction, class_names)
    if regions:
        image = _overlay_regions(image[..., :3] if image.ndim == 3 else np.repeat(image[..., None], 3, 2), regions)
    canvas = Image.fromarray(_overlay_masks(image, prediction.instances)).convert("RGB")
    draw = ImageDraw.Draw(canvas)
    face = font(max(11, min(canvas.size) // 40))
    width = max(1, min(canvas.size) // 300)
    title_box = _title(draw, canvas.size, title) if title else None
    anchors, sizes, labels = [], [], []
    smallest = 0.001 * canvas.size[0] * canvas.size[1]  # regions smaller than this go unlabelled: clutter
    for mask, colour, label in regions:
        point = interior_point(mask) if mask.sum() >= smallest else None
        label = displayable(label, face)
        if point is None or not label:
            continue
        left, top, right, bottom = draw.textbbox((0, 0), label, font=face)
        w, h = right - left + 4, bottom - top + 4
        # a zero-height anchor below the point: place_labels' first choice (above it) centres the label on it
        x, y = point
        anchors.append((x - w / 2, y + h / 2, x + w / 2, y + h / 2))
        sizes.append((w, h))
        labels.append((label, colour, left, top))
    for i, inst in enumerate(prediction.instances):
        colour = _colour(i)
        shapes = _outlines(inst)
        for points, closed in shapes:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            if max(xs) - min(xs) < 2 and max(ys) - min(ys) < 2:  # points (nearly) coincide: a visible marker
                r = width + 2
                draw.rectangle((min(xs) - r, min(ys) - r, max(xs) + r, max(ys) + r), outline=colour, width=width)
            elif len(points) >= 2:
                draw.line(points + (points[:1] if closed else []), fill=colour, width=width, joint="curve")
        for x, y, *_ in inst.keypoints or []:
            draw.ellipse((x - width - 1, y - width - 1, x + width + 1, y + width + 1), fill=colour)
        label = displayable(_label(inst, show_scores), face)
        points = [p for pts, _ in shapes for p in pts]
        if label and points:
            left, top, right, bottom = draw.textbbox((0, 0), label, font=face)
            anchors.append((min(p[0] for p in points), min(p[1] for p in points),
                            max(p[0] for p in points), max(p[1] for p in points)))
            sizes.append((right - left + 4, bottom - top + 4))
            labels.append((label, colour, left, top))
    boxes = place_labels(anchors, sizes, *canvas.size, avoid=[title_box] if title_box else [])
    for (x0, y0, x1, y1), (label, colour, left, top) in zip(boxes, labels):
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=colour)
        draw.text((x0 + 2 - left, y0 + 2 - top), label, fill=(0, 0, 0), font=face)
    if title:
        _title(draw, canvas.size, title)  # on top, in case a label had nowhere else to go
    return canvas


def _title(draw, size: tuple[int, int], text: str) -> Box:
    """A title at the top-left corner; returns its box."""
    face = font(max(12, min(size) // 30))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=face)
    box = (0, 0, right - left + 8, bottom - top + 8)
    draw.rectangle(box, fill=(0, 0, 0))
    draw.text((4 - left, 4 - top), text, fill=(255, 255, 255), font=face)
    return box


def side_by_side(pictures: Sequence, gap: int = 8):
    """PIL pictures of equal height next to each other on a white background (e.g. PyTorch | ONNX)."""
    from PIL import Image

    width = sum(p.width for p in pictures) + gap * (len(pictures) - 1)
    out = Image.new("RGB", (width, max(p.height for p in pictures)), (255, 255, 255))
    x = 0
    for p in pictures:
        out.paste(p, (x, 0))
        x += p.width + gap
    return out
