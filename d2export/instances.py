"""What a served model found, in the original picture's pixels: one `Instance` per detection, whatever the family.

Torch-free: family modules build these from graph outputs (numpy) and the runtime serialises and draws them. Fields a
family does not produce stay None and are left out of the JSON.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace
from typing import Any

import numpy as np

_POINT_LISTS = ("polygon", "beziers", "boundary", "keypoints")


@dataclass
class Instance:
    score: float
    label: int
    class_name: str | None = None  # from the dataset's metadata, where the manifest knows it
    box: list[float] | None = None  # [x0, y0, x1, y1]
    polygon: list[list[float]] | None = None  # [[x, y], …]: an outline, or a text centre line (see `closed`)
    closed: bool = True  # False: `polygon` is an open polyline (DeepSolo's centre line)
    text: str | None = None
    text_score: float | None = None  # mean probability of the characters kept (0 when none)
    language: str | None = None  # the script its text was read in (multilingual spotters: DeepSolo++)
    beziers: list[list[float]] | None = None  # 8 Bézier control points, for Bézier-mode text spotters
    boundary: list[list[float]] | None = None  # a closed outline around a centre line
    keypoints: list[list[float]] | None = None  # [[x, y, score], …]
    mask: dict[str, Any] | None = None  # {"size": [h, w], "counts": …}: COCO run-length encoding
    stuff: bool | None = None  # True: a panoptic "stuff" region (mask and label only; its score is 1)


TextInstance = Instance  # the name the first release used


@dataclass
class Segment:
    """One region of a panoptic map: the pixels of `Prediction.panoptic` equal to `id`."""
    id: int
    category_id: int  # the model's contiguous class index
    isthing: bool
    class_name: str | None = None


@dataclass
class Prediction:
    height: int  # the original picture's size
    width: int
    instances: list[Instance] = field(default_factory=list)
    # segmentation models (per pixel, the original picture's size); None where the model makes no such map
    semantic: np.ndarray | None = None  # [H, W] int32: the class of each pixel (argmax of the semantic scores)
    panoptic: np.ndarray | None = None  # [H, W] int32: the segment id of each pixel, 0 where no segment is
    segments: list[Segment] | None = None  # the panoptic map's segments

    def to_dict(self, decimals: int = 2) -> dict[str, Any]:
        """JSON-ready; coordinates rounded to `decimals` (a hundredth of a pixel by default); absent fields dropped.
        Pixel maps are not JSON: where there are some, their shape is said (serving writes them as PNG)."""
        maps = {k: getattr(self, k) for k in ("semantic", "panoptic")}
        d = asdict(dataclasses_replace(self, semantic=None, panoptic=None))
        for key, value in maps.items():
            if value is None:
                del d[key]
            else:
                d[key] = {"shape": list(value.shape)}
        if d["segments"] is None:
            del d["segments"]
        else:
            d["segments"] = [{k: v for k, v in s.items() if v is not None} for s in d["segments"]]
        for inst in d["instances"]:
            for key in [k for k, v in inst.items() if v is None]:
                del inst[key]
            for key in _POINT_LISTS:
                if key in inst:
                    inst[key] = [[round(v, decimals) for v in p] for p in inst[key]]
            if "box" in inst:
                inst["box"] = [round(v, decimals) for v in inst["box"]]
            if inst.get("closed", True):
                inst.pop("closed", None)
        return d


def encode_mask(mask: np.ndarray) -> dict[str, Any]:
    """HxW bool → COCO run-length encoding {"size": [h, w], "counts": …}: pycocotools' compressed string where it is
    installed (what COCO tools expect); else the uncompressed counts list (also valid COCO RLE, read by pycocotools'
    frPyObjects), so a serving image without pycocotools' C extension still serves masks."""
    try:
        from pycocotools import mask as coco_mask
    except ImportError:
        column_major = np.asfortranarray(mask).ravel(order="F").astype(np.int8)
        changes = np.flatnonzero(np.diff(np.concatenate([[0], column_major, [1 - column_major[-1]]])))
        return {"size": list(mask.shape), "counts": np.diff(np.concatenate([[0], changes])).tolist()}
    rle = coco_mask.encode(np.asfortranarray(mask, bool).view(np.uint8))  # a column-major mask is not copied
    return {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")}


def decode_mask(rle: dict[str, Any]) -> np.ndarray:
    """COCO RLE (either form `encode_mask` writes) → HxW bool."""
    h, w = rle["size"]
    counts = rle["counts"]
    if isinstance(counts, str):
        from pycocotools import mask as coco_mask

        return coco_mask.decode({"size": [h, w], "counts": counts.encode("ascii")}).astype(bool)
    values = np.repeat(np.arange(len(counts)) % 2, counts).astype(bool)
    return values.reshape(w, h).T
