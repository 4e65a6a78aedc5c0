"""Pictures of the model's own domain, read from a folder (`d2export synth` writes one) or a registered detectron2
dataset: what int8 calibrates on (`export.calibration`) and, with `verify.pictures`, what verification compares on
instead of synthetic bars and strokes (a reader is judged on text it reads, not on strokes it guesses at)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


def picture_files(source: str, count: int, setting: str = "export.calibration") -> list[Path]:
    """The first `count` pictures of a folder (or its images/) or a registered dataset, in a fixed order; `setting`
    names the config key in errors."""
    folder = Path(source)
    if folder.is_dir():
        root = folder / "images" if (folder / "images").is_dir() else folder
        files = sorted(p for p in root.iterdir() if p.suffix.lower() in SUFFIXES)
    else:
        from detectron2.data import DatasetCatalog

        if source not in DatasetCatalog.list():
            raise ValueError(f"{setting}={source!r} is neither a folder nor a registered dataset")
        files = [Path(r["file_name"]) for r in DatasetCatalog.get(source)]
    if not files:
        raise ValueError(f"{setting}={source!r} holds no pictures")
    return files[:count]


def picture_at(file: Path, height: int, width: int, pixel_format: str) -> np.ndarray:
    """A picture file stretched to exactly `height` x `width` (bilinear, as detectron2 resizes), CHW uint8 in the
    model's pixel format ("RGB" or "BGR", cfg.INPUT.FORMAT): a verification case at a size of its choosing."""
    from PIL import Image

    with Image.open(file) as im:
        rgb = np.asarray(im.convert("RGB").resize((width, height), Image.BILINEAR))
    hwc = rgb[:, :, ::-1] if pixel_format == "BGR" else rgb
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))
