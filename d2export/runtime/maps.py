"""A prediction's served kinds with a file form (d2export/served_kinds/: a segmentation model's pixel maps) as PNG
bytes, and the JSON the server, Triton's ensemble and `d2export batch` answer with those bytes inline as base64.

`d2export infer` writes the same bytes as files beside its JSON lines and names the files. A prediction without maps
(every detector and text spotter) is answered exactly as before: none of their keys appear.
"""
from __future__ import annotations

import base64
from typing import Any

import importlib
import warnings

from d2export.instances import Prediction
from d2export.served_kinds import kinds

__all__ = ["map_pngs", "prediction_json"]

# names this module once held, now where each kind is declared: they import with a DeprecationWarning
_MOVED = {"semantic_png": ("d2export.served_kinds.semantic", "semantic_png"),
          "panoptic_png": ("d2export.served_kinds.panoptic", "panoptic_png"),
          "read_png_map": ("d2export.served_kinds.pixel_maps", "read_ids")}


def __getattr__(name: str):
    if name == "MAPS":
        warnings.warn("d2export.runtime.maps.MAPS is deprecated: the kinds with a PNG form are "
                      "[k.name for k in d2export.served_kinds.kinds('picture') if k.png]", DeprecationWarning, 2)
        return tuple(k.name for k in kinds("picture") if k.png is not None)
    if name in _MOVED:
        module, attr = _MOVED[name]
        warnings.warn(f"d2export.runtime.maps.{name} is deprecated: use {module}.{attr}", DeprecationWarning, 2)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
