"""The semantic map (`Prediction.semantic`): each pixel's class id, served as a greyscale PNG (8-bit where every id is
below 256, else 16-bit); in detectron2's output dict, the `sem_seg` scores whose argmax it is."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from d2export.served_kinds.declaration import PngForm, ServedKind
from d2export.served_kinds.pixel_maps import compare_maps, grey_png, read_ids, shape_json


def semantic_png(semantic: np.ndarray) -> bytes:
    """[H, W] class ids → greyscale PNG bytes (8-bit where every id is below 256, else 16-bit)."""
    return grey_png(semantic, "semantic class ids")


def regions(prediction: Any, name: Callable[[int], str]) -> list[tuple[np.ndarray, int, str]] | None:
    """Each class present, coloured by its id (one class has one colour in every picture)."""
    if prediction.semantic is None:
        return None
    return [(prediction.semantic == c, int(c), name(int(c))) for c in np.unique(prediction.semantic)]


def from_detectron2(output: dict[str, Any], post: dict[str, Any]) -> np.ndarray | None:
    scores = output.get("sem_seg")  # [K, H, W]
    return None if scores is None else scores.argmax(dim=0).cpu().numpy().astype(np.int32)


def to_detectron2(prediction: Any, post: dict[str, Any]) -> dict[str, Any]:
    """`sem_seg`: one-hot [K, H, W] uint8 scores (K: the manifest's `num_classes`) whose argmax is the served map
    (the runtime keeps the map, not the scores)."""
    if prediction.semantic is None:
        return {}
    import torch

    labels = torch.as_tensor(prediction.semantic, dtype=torch.int64)
    k = int(post.get("num_classes") or int(labels.max()) + 1)
    return {"sem_seg": torch.zeros((k, *labels.shape), dtype=torch.uint8).scatter_(0, labels[None], 1)}


SEMANTIC = ServedKind(
    "semantic", "picture", "np.ndarray | None", "[H, W] int32: the class of each pixel (argmax of the semantic scores)",
    to_json=shape_json, png=PngForm(semantic_png, read_ids, ".semantic.png"),
    regions=regions, regions_rank=1,  # drawn where there is no panoptic map
    compare=compare_maps("semantic"), from_detectron2=from_detectron2, to_detectron2=to_detectron2)

KINDS = (SEMANTIC,)
