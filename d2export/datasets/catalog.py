"""Registering a synthetic set (or any folder laid out as `d2export synth` writes it) in detectron2's catalogs."""
from __future__ import annotations

import json
from pathlib import Path

from d2export.datasets.synth import ANNOTATIONS, IMAGES

# AdelaiDet's loader (adet/data/datasets/text.py) hands its mapper these names for the JSON's fields
TEXT_FIELDS = {"bezier_pts": "beziers", "polys": "polygons", "rec": "text"}


def load_text(json_file: str, image_root: str, name: str | None = None) -> list[dict]:
    """detectron2's COCO loader with the text fields kept, each also under the name AdelaiDet's loader gives it
    (`beziers`, `polygons`, `text`; `rec` stays too, as AdelaiDet's does)."""
    from detectron2.data.datasets import load_coco_json

    records = load_coco_json(json_file, image_root, name, extra_annotation_keys=list(TEXT_FIELDS))
    for record in records:
        for obj in record["annotations"]:
            obj.update({alias: obj[key] for key, alias in TEXT_FIELDS.items() if key in obj})
    return records


def register(name: str, folder: str | Path) -> str:
    """Register the set `d2export synth` wrote in `folder` as `name` (see register_json)."""
    folder = Path(folder)
    if not (folder / ANNOTATIONS).is_file():
        raise FileNotFoundError(f"{folder / ANNOTATIONS} not found: is {folder} a folder `d2export synth` wrote?")
    return register_json(name, folder / ANNOTATIONS, folder / IMAGES)


def is_text_set(coco: dict) -> bool:
    """A text set: `d2export synth text` says so; any other COCO JSON whose annotations carry transcriptions."""
    kind = coco.get("info", {}).get("kind")
    return kind == "text" if kind else any("rec" in a for a in coco.get("annotations", [])[:1])


def register_json(name: str, json_file: str | Path, image_root: str | Path) -> str:
    """Register a COCO JSON as `name` in DatasetCatalog and MetadataCatalog. Boxes and masks go through detectron2's
    own `register_coco_instances` (COCOEvaluator scores them); a text set keeps its Bezier, boundary and transcription
    fields and says how they are encoded (voc_size, max_text_len) in its metadata."""
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from detectron2.data.datasets import register_coco_instances

    json_file, image_root = str(json_file), str(image_root)
    with open(json_file) as f:
        coco = json.load(f)
    if is_text_set(coco):
        info = coco.get("info", {})
        DatasetCatalog.register(name, lambda: load_text(json_file, image_root, name))
        MetadataCatalog.get(name).set(json_file=json_file, image_root=image_root, evaluator_type="text",
                                      thing_classes=[c["name"] for c in coco.get("categories", [])] or ["text"],
                                      voc_size=info.get("voc_size", 96), max_text_len=info.get("max_text_len", 25))
    else:
        register_coco_instances(name, {}, json_file, image_root)
    return name


def text_record(seed: int, index: int, size: tuple[int, int]) -> dict:
    """Picture `index` of the text set of `seed` as detectron2's dataset dict, drawn in memory: the same JPEG bytes
    `d2export synth text` writes for it, decoded (RGB, under "image"), with the fields `load_text` gives its record.
    Training streams these (an endless seeded set, nothing on disk)."""
    import cv2
    import numpy as np
    from detectron2.structures import BoxMode

    from d2export.datasets.synth import _picture

    width, height = size
    jpeg, anns = _picture(("text", seed, index, width, height))
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)[..., ::-1]
    objs = [{**a, "bbox_mode": BoxMode.XYWH_ABS, "category_id": a["category_id"] - 1,  # the only category: text
             **{alias: a[key] for key, alias in TEXT_FIELDS.items() if key in a}} for a in anns]
    return {"image": np.ascontiguousarray(image), "height": height, "width": width, "image_id": index + 1,
            "annotations": objs}
