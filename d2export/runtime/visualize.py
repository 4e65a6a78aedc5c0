"""A picture of a prediction: polygons outlined and their text written beside them, on the original picture."""
from __future__ import annotations

import colorsys

import numpy as np

from d2export.runtime.predictor import Prediction


def _colour(i: int) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.85, 0.95)  # golden-ratio hues: neighbours differ
    return int(r * 255), int(g * 255), int(b * 255)


def draw_prediction(image: np.ndarray, prediction: Prediction, show_scores: bool = True):
    """HWC uint8 RGB + its prediction → a PIL image (save it as PNG)."""
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.fromarray(np.ascontiguousarray(image)).convert("RGB")
    draw = ImageDraw.Draw(canvas)
    size = max(10, min(canvas.size) // 40)
    try:
        font = ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        font = ImageFont.load_default()
    width = max(1, min(canvas.size) // 300)
    for i, inst in enumerate(prediction.instances):
        colour = _colour(i)
        points = [tuple(p) for p in inst.polygon]
        if len(points) >= 2:
            draw.line(points + points[:1], fill=colour, width=width)
        label = inst.text + (f" {inst.score:.2f}" if show_scores else "")
        if label and points:
            x, y = min(p[0] for p in points), min(p[1] for p in points)
            box = draw.textbbox((x, y), label, font=font, anchor="lb")
            draw.rectangle(box, fill=colour)
            draw.text((x, y), label, fill=(0, 0, 0), font=font, anchor="lb")
    return canvas
