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
    """Register the set in `folder` as `name` in DatasetCatalog and MetadataCatalog. A box set goes through
    detectron2's own `register_coco_instances` (COCOEvaluator scores it); a text set keeps its Bezier, boundary
    and transcription fields and says how they are encoded (voc_size, max_text_len) in its metadata."""
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from detectron2.data.datasets import register_coco_instances

    folder = Path(folder)
    json_file, image_root = folder / ANNOTATIONS, folder / IMAGES
    if not json_file.is_file():
        raise FileNotFoundError(f"{json_file} not found: is {folder} a folder `d2export synth` wrote?")
    with open(json_file) as f:
        info = json.load(f).get("info", {})
    if info.get("kind") == "text":
        DatasetCatalog.register(name, lambda: load_text(str(json_file), str(image_root), name))
        MetadataCatalog.get(name).set(json_file=str(json_file), image_root=str(image_root), evaluator_type="text",
                                      thing_classes=["text"], voc_size=info["voc_size"],
                                      max_text_len=info["max_text_len"])
    else:
        register_coco_instances(name, {}, str(json_file), str(image_root))
    return name
