"""What every per-pixel kind shares: integer ids as PNG (greyscale 8- or 16-bit, or COCO panoptic's 24-bit RGB) and
back, the JSON form that says a map's shape, and how two runs' maps are compared. numpy and Pillow only."""
from __future__ import annotations

import io
from typing import Any, Callable

import numpy as np

MAP_SHARE = 0.001  # pixel maps differing in more of their pixels than this differ


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def grey_png(ids: np.ndarray, what: str = "ids") -> bytes:
    """[H, W] non-negative ids → greyscale PNG bytes, 8-bit where every id is below 256, else 16-bit; `what` names
    the ids in the error when one does not fit 16 bits."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 16):
        raise ValueError(f"{what} {ids.min()}..{ids.max()} do not fit a 16-bit PNG")
    if not ids.size or ids.max() < 256:
        return _png(ids.astype(np.uint8))
    return _png(ids.astype(np.uint16))


def rgb_png(ids: np.ndarray) -> bytes:
    """[H, W] ids below 2²⁴ → RGB PNG bytes in COCO panoptic's encoding, id = R + 256·G + 256²·B."""
    ids = np.asarray(ids).astype(np.uint32)
    return _png(np.stack([ids & 0xFF, (ids >> 8) & 0xFF, (ids >> 16) & 0xFF], -1).astype(np.uint8))


def read_ids(data: bytes) -> np.ndarray:
    """PNG bytes `grey_png` or `rgb_png` wrote → [H, W] int32 ids (RGB read as R + 256·G + 256²·B)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image)
    if pixels.ndim == 3:
        pixels = pixels[..., :3].astype(np.int32)
        return pixels[..., 0] + 256 * pixels[..., 1] + 65536 * pixels[..., 2]
    return pixels.astype(np.int32)


def shape_json(ids: np.ndarray) -> dict[str, Any]:
    """A map's JSON form: its shape only (the pixels travel as PNG: a file, a column, or base64 beside the shape)."""
    return {"shape": list(ids.shape)}


def compare_maps(name: str) -> Callable[[Any, Any], tuple[float, str] | None]:
    """Two runs' maps of kind `name` differ where over MAP_SHARE of their pixels do (severity 10⁴ · that share);
    a map one run lacks is not compared."""

    def compare(a: np.ndarray | None, b: np.ndarray | None) -> tuple[float, str] | None:
        if a is None or b is None:
            return None
        share = float(np.mean(a != b)) if a.shape == b.shape else 1.0
        return (1e4 * share, f"{name} maps differ in {share:.2%} of their pixels") if share > MAP_SHARE else None

    return compare
