"""The panoptic map (`Prediction.panoptic`: each pixel's segment id, 0 where no segment is) and its `segments` (each
id's class), served as an RGB PNG in COCO panoptic's encoding and a JSON list; in detectron2's output dict, the
`panoptic_seg` pair (ids, segments_info)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from d2export.served_kinds.declaration import CATEGORICAL, PngForm, ServedKind
from d2export.served_kinds.pixel_maps import compare_maps, read_ids, rgb_png, shape_json


@dataclass
class Segment:
    """One region of a panoptic map: the pixels of `Prediction.panoptic` equal to `id`."""
    id: int
    category_id: int  # the model's contiguous class index
    isthing: bool
    class_name: str | None = None


def panoptic_png(panoptic: np.ndarray) -> bytes:
    """[H, W] segment ids → RGB PNG bytes in COCO panoptic's encoding (id = R + 256·G + 256²·B)."""
    return rgb_png(panoptic)


def regions(prediction: Any, name: Callable[[int], str]) -> list[tuple[np.ndarray, int, str]] | None:
    """Each segment, coloured by its id (things of one class apart), labelled with its class."""
    if prediction.panoptic is None:
        return None
    return [(prediction.panoptic == s.id, s.id, s.class_name or name(s.category_id)) for s in prediction.segments or []]


def map_from_detectron2(output: dict[str, Any], post: dict[str, Any]) -> np.ndarray | None:
    if output.get("panoptic_seg") is None:
        return None
    return output["panoptic_seg"][0].cpu().numpy().astype(np.int32)


def to_detectron2(prediction: Any, post: dict[str, Any]) -> dict[str, Any]:
    """`panoptic_seg`: the ids as a tensor and each segment's id, class and whether it is a thing."""
    if prediction.panoptic is None:
        return {}
    import torch

    return {"panoptic_seg": (torch.as_tensor(prediction.panoptic),
                             [{"id": s.id, "category_id": s.category_id, "isthing": s.isthing}
                              for s in prediction.segments or []])}


def segments_json(segments: list[Segment]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(s).items() if v is not None} for s in segments]


def compare_segments(a: list[Segment] | None, b: list[Segment] | None) -> tuple[float, str] | None:
    """Two runs' segments differ where their ids or classes do (a run without them has none)."""
    x, y = ([(s.id, s.category_id) for s in segments or []] for segments in (a, b))
    return None if x == y else (CATEGORICAL, f"panoptic segments {len(x)} vs {len(y)} (ids, classes)")


def segments_from_detectron2(output: dict[str, Any], post: dict[str, Any]) -> list[Segment] | None:
    if output.get("panoptic_seg") is None:
        return None
    names = post.get("class_names") or []
    return [Segment(int(s["id"]), int(s["category_id"]), bool(s["isthing"]),
                    names[s["category_id"]] if 0 <= s["category_id"] < len(names) else None)
            for s in output["panoptic_seg"][1]]


PANOPTIC = ServedKind(
    "panoptic", "picture", "np.ndarray | None", "[H, W] int32: the segment id of each pixel, 0 where no segment is",
    to_json=shape_json, png=PngForm(panoptic_png, read_ids, ".panoptic.png"),
    regions=regions, regions_rank=0,  # drawn over the semantic classes: where there is a panoptic map, only it
    compare=compare_maps("panoptic"), from_detectron2=map_from_detectron2, to_detectron2=to_detectron2)

SEGMENTS = ServedKind(  # drawn, and given to detectron2, with the map
    "segments", "picture", "list[Segment] | None", "the panoptic map's segments",
    to_json=segments_json, compare=compare_segments, from_detectron2=segments_from_detectron2)

KINDS = (PANOPTIC, SEGMENTS)
