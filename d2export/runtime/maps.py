"""A segmentation model's pixel maps as files and JSON: PNG pictures a client reads with Pillow.

- semantic: [H, W] class ids as a greyscale PNG, 8-bit where every id fits (< 256), else 16-bit;
- panoptic: [H, W] segment ids in COCO panoptic's RGB encoding, id = R + 256·G + 256²·B (0: no segment), which COCO's
  panopticapi reads as it is; `segments` say each id's class.

`d2export infer` writes them as files beside its JSON lines and names the files; the server, Triton's ensemble and
`d2export batch` carry the same PNG bytes in the JSON, base64-encoded. A prediction without maps (every detector and
text spotter) is answered exactly as before: none of these keys appear.
"""
from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from d2export.instances import Prediction

MAPS = ("semantic", "panoptic")


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def semantic_png(semantic: np.ndarray) -> bytes:
    """[H, W] class ids → greyscale PNG bytes (8-bit where every id is below 256, else 16-bit)."""
    from PIL import Image

    semantic = np.asarray(semantic)
    if semantic.size and (semantic.min() < 0 or semantic.max() >= 1 << 16):
        raise ValueError(f"semantic class ids {semantic.min()}..{semantic.max()} do not fit a 16-bit PNG")
    if not semantic.size or semantic.max() < 256:
        return _png(Image.fromarray(semantic.astype(np.uint8)))
    return _png(Image.fromarray(semantic.astype(np.uint16)))


def panoptic_png(panoptic: np.ndarray) -> bytes:
    """[H, W] segment ids → RGB PNG bytes in COCO panoptic's encoding (id = R + 256·G + 256²·B)."""
    from PIL import Image

    ids = np.asarray(panoptic).astype(np.uint32)
    rgb = np.stack([ids & 0xFF, (ids >> 8) & 0xFF, (ids >> 16) & 0xFF], -1).astype(np.uint8)
    return _png(Image.fromarray(rgb))


def read_png_map(data: bytes) -> np.ndarray:
    """PNG bytes as `semantic_png` or `panoptic_png` wrote them → [H, W] int32 ids."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image)
    if pixels.ndim == 3:  # panoptic: id = R + 256·G + 256²·B
        pixels = pixels[..., :3].astype(np.int32)
        return pixels[..., 0] + 256 * pixels[..., 1] + 65536 * pixels[..., 2]
    return pixels.astype(np.int32)


def map_pngs(prediction: Prediction) -> dict[str, bytes]:
    """The prediction's maps as PNG bytes: {"semantic": …, "panoptic": …}, those it has."""
    encode = {"semantic": semantic_png, "panoptic": panoptic_png}
    return {k: encode[k](getattr(prediction, k)) for k in MAPS if getattr(prediction, k) is not None}


def prediction_json(prediction: Prediction, pngs: dict[str, bytes] | None = None) -> dict[str, Any]:
    """`Prediction.to_dict()` with each map's PNG bytes inline as base64 (`"png_base64"`, beside its `"shape"`), as the
    server, Triton and `batch` answer; `pngs` where the caller encoded them already."""
    d = prediction.to_dict()
    for key, data in (map_pngs(prediction) if pngs is None else pngs).items():
        d[key]["png_base64"] = base64.b64encode(data).decode("ascii")
    return d
