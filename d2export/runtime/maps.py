"""A prediction's served kinds with a file form (d2export/served_kinds/: a segmentation model's pixel maps) as PNG
bytes, and the JSON the server, Triton's ensemble and `d2export batch` answer with those bytes inline as base64.

`d2export infer` writes the same bytes as files beside its JSON lines and names the files. A prediction without maps
(every detector and text spotter) is answered exactly as before: none of their keys appear.
"""
from __future__ import annotations

import base64
from typing import Any

from d2export.instances import Prediction
from d2export.served_kinds import kinds
from d2export.served_kinds.panoptic import panoptic_png
from d2export.served_kinds.pixel_maps import read_ids as read_png_map
from d2export.served_kinds.semantic import semantic_png

__all__ = ["MAPS", "map_pngs", "prediction_json", "read_png_map", "semantic_png", "panoptic_png"]

MAPS = tuple(k.name for k in kinds("picture") if k.png is not None)  # ("semantic", "panoptic")


def map_pngs(prediction: Prediction) -> dict[str, bytes]:
    """The prediction's maps as PNG bytes, by kind ({"semantic": …, "panoptic": …}), those it has."""
    return {k.name: k.png.encode(getattr(prediction, k.name)) for k in kinds("picture")
            if k.png is not None and getattr(prediction, k.name) is not None}


def prediction_json(prediction: Prediction, pngs: dict[str, bytes] | None = None) -> dict[str, Any]:
    """`Prediction.to_dict()` with each map's PNG bytes inline as base64 (`"png_base64"`, beside its `"shape"`), as the
    server, Triton and `batch` answer; `pngs` where the caller encoded them already."""
    d = prediction.to_dict()
    for key, data in (map_pngs(prediction) if pngs is None else pngs).items():
        d[key]["png_base64"] = base64.b64encode(data).decode("ascii")
    return d
