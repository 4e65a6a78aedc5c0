"""A picture of a prediction: masks (translucent), outlines (polygons, boxes, boundaries, centre lines), keypoints and
labels, on the original picture.
Generic over `Instance` fields, so every family draws without code of its own."""
from __future__ import annotations

import colorsys

import numpy as np

from d2export.instances import Instance, Prediction, decode_mask


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


def draw_prediction(image: np.ndarray, prediction: Prediction, show_scores: bool = True):
    """HWC uint8 RGB + its prediction → a PIL image (save it as PNG)."""
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.fromarray(_overlay_masks(np.asarray(image), prediction.instances)).convert("RGB")
    draw = ImageDraw.Draw(canvas)
    size = max(10, min(canvas.size) // 40)
    try:
        font = ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        font = ImageFont.load_default()
    width = max(1, min(canvas.size) // 300)
    for i, inst in enumerate(prediction.instances):
        colour = _colour(i)
        shapes = _outlines(inst)
        for points, closed in shapes:
            if len(points) >= 2:
                draw.line(points + (points[:1] if closed else []), fill=colour, width=width)
        for x, y, *_ in inst.keypoints or []:
            draw.ellipse((x - width - 1, y - width - 1, x + width + 1, y + width + 1), fill=colour)
        label = _label(inst, show_scores)
        anchor = [p for points, _ in shapes for p in points]
        if label and anchor:
            x, y = min(p[0] for p in anchor), min(p[1] for p in anchor)
            box = draw.textbbox((x, y), label, font=font, anchor="lb")
            draw.rectangle(box, fill=colour)
            draw.text((x, y), label, fill=(0, 0, 0), font=font, anchor="lb")
    return canvas
