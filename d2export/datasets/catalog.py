"""Registering a synthetic set (or any folder laid out as `d2export synth` writes it) in detectron2's catalogs."""
from __future__ import annotations

import json
from pathlib import Path

from d2export.datasets.layout import ANNOTATIONS, IGNORE_LABEL, IMAGES, PANOPTIC, PANOPTIC_JSON, SEMANTIC

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
    """Register the set `d2export synth` wrote in `folder` as `name` (see register_json), with its per-pixel labels
    where it has them (`--segmentation`)."""
    folder = Path(folder)
    if not (folder / ANNOTATIONS).is_file():
        raise FileNotFoundError(f"{folder / ANNOTATIONS} not found: is {folder} a folder `d2export synth` wrote?")
    if (folder / PANOPTIC_JSON).is_file():
        return register_json(name, folder / ANNOTATIONS, folder / IMAGES, folder / PANOPTIC_JSON, folder / PANOPTIC,
                             folder / SEMANTIC if (folder / SEMANTIC).is_dir() else None)
    return register_json(name, folder / ANNOTATIONS, folder / IMAGES)


def panoptic_metadata(categories: list[dict]) -> dict:
    """COCO panoptic categories (with `isthing`) → the metadata detectron2's evaluators and Mask2Former read. Contiguous
    ids: the things first (so they are also the instance JSON's contiguous ids, as COCOEvaluator wants them), then
    the stuff, each in the JSON's order; `stuff_*` name every class, things too (Mask2Former's convention: the
    semantic evaluator scores every class)."""
    ordered = [c for c in categories if c.get("isthing")] + [c for c in categories if not c.get("isthing")]
    contiguous = {int(c["id"]): i for i, c in enumerate(ordered)}
    things = [c for c in ordered if c.get("isthing")]
    return {"thing_classes": [c["name"] for c in things],
            "thing_dataset_id_to_contiguous_id": {int(c["id"]): contiguous[int(c["id"])] for c in things},
            "stuff_classes": [c["name"] for c in ordered], "stuff_dataset_id_to_contiguous_id": contiguous,
            "ignore_label": IGNORE_LABEL, "label_divisor": 1000}


def load_segmentation(json_file: str, image_root: str, panoptic_json: str, panoptic_root: str,
                      sem_seg_root: str | None, meta: dict, name: str | None = None) -> list[dict]:
    """detectron2's COCO records, each with its panoptic labels as detectron2's COCO-panoptic loader gives them
    (`pan_seg_file_name`, `segments_info` with contiguous ids) and its semantic map (`sem_seg_file_name`: the
    picture's name as .png in `sem_seg_root`), joined by image id."""
    from detectron2.data.datasets import load_coco_json
    from detectron2.data.datasets.coco_panoptic import load_coco_panoptic_json

    records = load_coco_json(json_file, image_root, name)
    panoptic = {r["image_id"]: r for r in load_coco_panoptic_json(panoptic_json, image_root, panoptic_root, meta)}
    for record in records:
        if record["image_id"] in panoptic:
            found = panoptic[record["image_id"]]
            record.update(pan_seg_file_name=found["pan_seg_file_name"], segments_info=found["segments_info"])
        if sem_seg_root:
            record["sem_seg_file_name"] = str(Path(sem_seg_root) / (Path(record["file_name"]).stem + ".png"))
    return records


def is_text_set(coco: dict) -> bool:
    """A text set: `d2export synth text` says so; any other COCO JSON whose annotations carry transcriptions."""
    kind = coco.get("info", {}).get("kind")
    return kind == "text" if kind else any("rec" in a for a in coco.get("annotations", [])[:1])


def register_json(name: str, json_file: str | Path, image_root: str | Path, panoptic_json: str | Path | None = None,
                  panoptic_root: str | Path | None = None, sem_seg_root: str | Path | None = None) -> str:
    """Register a COCO JSON as `name` in DatasetCatalog and MetadataCatalog. Boxes and masks go through detectron2's
    own `register_coco_instances` (COCOEvaluator scores them); a text set keeps its Bezier, boundary and transcription
    fields and says how they are encoded (voc_size, max_text_len) in its metadata. With a COCO panoptic JSON and its
    PNGs (and optionally semantic PNGs), the records also carry those and the metadata says what the segmentation
    evaluators read (`panoptic_metadata`; `panoptic_root`, `panoptic_json`, `sem_seg_root`)."""
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from detectron2.data.datasets import register_coco_instances

    json_file, image_root = str(json_file), str(image_root)
    with open(json_file) as f:
        coco = json.load(f)
    if panoptic_json:
        panoptic_json, panoptic_root = str(panoptic_json), str(panoptic_root)
        sem_seg_root = str(sem_seg_root) if sem_seg_root else None
        with open(panoptic_json) as f:
            meta = panoptic_metadata(json.load(f)["categories"])
        DatasetCatalog.register(name, lambda: load_segmentation(json_file, image_root, panoptic_json, panoptic_root,
                                                                sem_seg_root, meta, name))
        roots = {"sem_seg_root": sem_seg_root} if sem_seg_root else {}
        MetadataCatalog.get(name).set(json_file=json_file, image_root=image_root, panoptic_json=panoptic_json,
                                      panoptic_root=panoptic_root, evaluator_type="coco_panoptic_seg", **roots, **meta)
    elif is_text_set(coco):
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
    jpeg, anns, _ = _picture(("text", seed, index, width, height))
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)[..., ::-1]
    objs = [{**a, "bbox_mode": BoxMode.XYWH_ABS, "category_id": a["category_id"] - 1,  # the only category: text
             **{alias: a[key] for key, alias in TEXT_FIELDS.items() if key in a}} for a in anns]
    return {"image": np.ascontiguousarray(image), "height": height, "width": width, "image_id": index + 1,
            "annotations": objs}
