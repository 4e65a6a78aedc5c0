"""What a served model found, in the original picture's pixels: one `Instance` per detection, whatever the family.

Torch-free: family modules build these from graph outputs (numpy) and the runtime serialises and draws them. Fields a
family does not produce stay None and are left out of the JSON. The served kinds' fields (d2export/served_kinds/:
`Prediction.semantic`, `.panoptic`, `.segments`, `Instance.language`) are added to the dataclasses from their
declarations, where each kind says its place; they are fields like any other (construction by keyword, `asdict`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace
from typing import Any

import numpy as np

from d2export.served_kinds import fields_for, kinds
from d2export.served_kinds.panoptic import Segment

__all__ = ["Instance", "TextInstance", "Segment", "Prediction", "encode_mask", "decode_mask"]

_POINT_LISTS = ("polygon", "beziers", "boundary", "keypoints")


def _served_fields(per: str):
    """Class decorator, under @dataclass: the fields of the served kinds declared `per` "picture" or "instance" added
    to the class's own, each `name: annotation = None`, after the field its kind names (else last), in the kinds'
    order; the class's docstring lists them."""

    def add(cls):
        placed = list(cls.__dict__.get("__annotations__", {}).items())
        last: dict[str, str] = {}  # a field → the kind field placed after it last (kinds after one field keep order)
        lines = []
        for kind in fields_for(per):
            names = [name for name, _ in placed]
            if kind.name in names:
                raise ValueError(f"served kind {kind.name!r}: {cls.__name__} has that field already")
            anchor = last.get(kind.after, kind.after)
            placed.insert(len(placed) if anchor is None else names.index(anchor) + 1, (kind.name, kind.annotation))
            if kind.after is not None:
                last[kind.after] = kind.name
            setattr(cls, kind.name, None)
            lines.append(f"    {kind.name}: {kind.about}")
        cls.__annotations__ = dict(placed)
        if lines:
            cls.__doc__ = (cls.__doc__ or "") + "\n\n    Served kinds (d2export/served_kinds/):\n" + "\n".join(lines)
        return cls

    return add


@dataclass
@_served_fields("instance")  # language (after text_score)
class Instance:
    """One detection."""
    score: float
    label: int
    class_name: str | None = None  # from the dataset's metadata, where the manifest knows it
    box: list[float] | None = None  # [x0, y0, x1, y1]
    polygon: list[list[float]] | None = None  # [[x, y], …]: an outline, or a text centre line (see `closed`)
    closed: bool = True  # False: `polygon` is an open polyline (DeepSolo's centre line)
    text: str | None = None
    text_score: float | None = None  # mean probability of the characters kept (0 when none)
    beziers: list[list[float]] | None = None  # 8 Bézier control points, for Bézier-mode text spotters
    boundary: list[list[float]] | None = None  # a closed outline around a centre line
    keypoints: list[list[float]] | None = None  # [[x, y, score], …]
    mask: dict[str, Any] | None = None  # {"size": [h, w], "counts": …}: COCO run-length encoding
    stuff: bool | None = None  # True: a panoptic "stuff" region (mask and label only; its score is 1)


TextInstance = Instance  # the name the first release used


def _instance_dict(inst: Instance, decimals: int) -> dict[str, Any]:
    d = asdict(inst)
    for kind in kinds("instance"):
        value = getattr(inst, kind.name)
        if value is not None:
            d[kind.name] = kind.to_json(value)
    for key in [k for k, v in d.items() if v is None]:
        del d[key]
    for key in _POINT_LISTS:
        if key in d:
            d[key] = [[round(v, decimals) for v in p] for p in d[key]]
    if "box" in d:
        d["box"] = [round(v, decimals) for v in d["box"]]
    if d.get("closed", True):
        d.pop("closed", None)
    return d


@dataclass
@_served_fields("picture")  # semantic, panoptic, segments: a segmentation model's, None where the model makes none
class Prediction:
    """What a served model found in one picture."""
    height: int  # the original picture's size
    width: int
    instances: list[Instance] = field(default_factory=list)

    def to_dict(self, decimals: int = 2) -> dict[str, Any]:
        """JSON-ready; coordinates rounded to `decimals` (a hundredth of a pixel by default); absent fields dropped.
        Each served kind in its JSON form: pixel maps are not JSON, their shape is said (serving writes them as PNG)."""
        picture = kinds("picture")
        d = asdict(dataclasses_replace(self, instances=[], **{k.name: None for k in picture}))  # no deep copies
        d["instances"] = [_instance_dict(inst, decimals) for inst in self.instances]
        for kind in picture:
            value = getattr(self, kind.name)
            if value is None:
                del d[kind.name]
            else:
                d[kind.name] = kind.to_json(value)
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


def coco_rle(rle: dict[str, Any]) -> dict[str, Any]:
    """Either form `encode_mask` writes as pycocotools' own RLE (needs pycocotools)."""
    from pycocotools import mask as coco_mask

    h, w = rle["size"]
    if isinstance(rle["counts"], str):
        return {"size": [h, w], "counts": rle["counts"].encode("ascii")}
    return coco_mask.frPyObjects({"size": [h, w], "counts": rle["counts"]}, h, w)


def decode_mask(rle: dict[str, Any]) -> np.ndarray:
    """COCO RLE (either form `encode_mask` writes) → HxW bool."""
    h, w = rle["size"]
    counts = rle["counts"]
    if isinstance(counts, str):
        from pycocotools import mask as coco_mask

        return coco_mask.decode(coco_rle(rle)).astype(bool)
    values = np.repeat(np.arange(len(counts)) % 2, counts).astype(bool)
    return values.reshape(w, h).T


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two boolean masks (two empty masks: 1.0, the same nothing)."""
    union = np.count_nonzero(a | b)
    return 1.0 if union == 0 else float(np.count_nonzero(a & b) / union)
