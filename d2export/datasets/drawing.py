"""Labels drawn over a synthetic set's pictures (`d2export synth --vis`): what a user checks before training on it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from d2export.charset import charset, decode

VIS = "vis"
GRID = "grid.jpg"


def _text_label(draw, ann: dict, voc_size: int, font) -> None:
    polys = np.asarray(ann["polys"]).reshape(-1, 2)
    draw.polygon([tuple(p) for p in polys], outline=(0, 255, 0), width=2)
    bez = np.asarray(ann["bezier_pts"]).reshape(-1, 2)
    for i, (x, y) in enumerate(bez):  # top curve's control points red, bottom's blue
        colour = (255, 40, 40) if i < 4 else (40, 120, 255)
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
    word = decode(ann["rec"], charset(voc_size))
    x, y = polys[0]
    draw.text((x, y - 14), word, fill=(255, 255, 0), font=font, stroke_width=2, stroke_fill=(0, 0, 0))


def _box_label(draw, ann: dict, names: dict, font) -> None:
    x, y, w, h = ann["bbox"]
    draw.rectangle([x, y, x + w, y + h], outline=(255, 255, 0), width=2)
    for poly in ann["segmentation"]:
        draw.polygon([tuple(p) for p in np.asarray(poly).reshape(-1, 2)], outline=(0, 255, 0), width=1)
    draw.text((x, y - 14), names[ann["category_id"]], fill=(255, 255, 0), font=font, stroke_width=2,
              stroke_fill=(0, 0, 0))


def draw_set(folder: str | Path, count: int) -> list[Path]:
    """Draw the labels of the first `count` pictures of a synthetic set into folder/vis, and up to four of them as
    one 2x2 grid (folder/vis/grid.jpg). Returns the files written."""
    from PIL import Image, ImageDraw, ImageFont

    folder = Path(folder)
    coco = json.loads((folder / "annotations.json").read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    by_image: dict[int, list[dict]] = {}
    for a in coco["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    font = ImageFont.load_default(13)
    (folder / VIS).mkdir(exist_ok=True)
    drawn, written = [], []
    for image in coco["images"][:count]:
        pic = Image.open(folder / "images" / image["file_name"]).convert("RGB")
        draw = ImageDraw.Draw(pic)
        for ann in by_image.get(image["id"], []):
            if "rec" in ann:
                _text_label(draw, ann, coco["info"].get("voc_size", 96), font)
            else:
                _box_label(draw, ann, names, font)
        path = folder / VIS / image["file_name"]
        pic.save(path, quality=90)
        drawn.append(pic)
        written.append(path)
    if drawn:
        tile = drawn[0].size
        cols = min(2, len(drawn))
        rows = (min(4, len(drawn)) + cols - 1) // cols
        grid = Image.new("RGB", (tile[0] * cols, tile[1] * rows))
        for i, pic in enumerate(drawn[:4]):
            grid.paste(pic, ((i % cols) * tile[0], (i // cols) * tile[1]))
        grid.save(folder / VIS / GRID, quality=85)
        written.append(folder / VIS / GRID)
    return written
