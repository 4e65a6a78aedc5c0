"""Labelled pictures by name: a dataset in detectron2's DatasetCatalog, a folder `d2export synth` wrote, or a COCO JSON
with its pictures, registered and loaded with each problem said in one line. `d2export evaluate` and int8's accuracy
verification (`verify.int8_accuracy`) read their pictures through it."""
from __future__ import annotations

import difflib
import json
from pathlib import Path


class EvaluateError(ValueError):
    """Bad input, said in one line."""


def registered_dataset(name: str) -> str:
    from detectron2.data import DatasetCatalog

    if name in DatasetCatalog.list():
        return name
    folder = Path(name)
    if (folder / "annotations.json").is_file():  # a folder `d2export synth` wrote
        from d2export.datasets import register

        dataset = f"d2export:{folder.resolve()}"
        return dataset if dataset in DatasetCatalog.list() else register(dataset, folder)
    known = sorted(DatasetCatalog.list())
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise EvaluateError(f"dataset {name!r} is neither registered nor a folder `d2export synth` wrote{hint} "
                        f"(registered: {', '.join(known)}; --imports names the module that registers yours, "
                        "or give --coco-json FILE --image-root DIR)")


def json_dataset(json_file: str, image_root: str, name: str | None) -> str:
    from detectron2.data import DatasetCatalog

    from d2export.datasets.catalog import register_json

    try:
        with open(json_file) as f:
            json.load(f)
    except FileNotFoundError:
        raise EvaluateError(f"--coco-json {json_file}: no such file") from None
    except json.JSONDecodeError as e:
        raise EvaluateError(f"--coco-json {json_file}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not Path(image_root).is_dir():
        raise EvaluateError(f"--image-root {image_root}: no such folder")
    dataset = name or f"d2export:{Path(json_file).resolve()}"
    return dataset if dataset in DatasetCatalog.list() else register_json(dataset, json_file, image_root)


def dataset_records(name: str, max_images: int | None) -> list[dict]:
    from detectron2.data import DatasetCatalog

    try:
        records = DatasetCatalog.get(name)
    except Exception as e:  # noqa: BLE001 - the user's loader or a malformed COCO JSON: said in one line
        raise EvaluateError(f"dataset {name!r} does not load: {type(e).__name__}: {e}") from None
    records = records[:max_images] if max_images else records
    if not records:
        raise EvaluateError(f"dataset {name!r} has no pictures")
    missing = [r["file_name"] for r in records if not Path(r["file_name"]).is_file()]
    if missing:
        raise EvaluateError(f"dataset {name!r} names {len(missing)} picture(s) that do not exist, e.g. "
                            f"{', '.join(missing[:3])}")
    return records
