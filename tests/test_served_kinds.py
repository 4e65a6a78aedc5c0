"""Served output kinds as data (d2export/served_kinds/): each kind's round trips against expectations written here
(PNG ids back as they were, 16-bit semantic ids, panoptic ids past 65535, the JSON forms); a kind declared only in
a script — a per-picture depth map and a per-instance orientation — reaching Prediction.to_dict, infer's files,
batch's columns, the served JSON and evaluate's comparison with no other module edited; DeepSolo++'s language served
as before."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from d2export import served_kinds
from d2export.instances import Instance, Prediction, Segment
from d2export.served_kinds.declaration import CATEGORICAL, ServedKind
from d2export.served_kinds.language import LANGUAGE
from d2export.served_kinds.panoptic import PANOPTIC, SEGMENTS
from d2export.served_kinds.semantic import SEMANTIC

ROOT = Path(__file__).resolve().parent.parent


def pixels(data: bytes) -> tuple[str, np.ndarray]:
    with Image.open(io.BytesIO(data)) as picture:
        return picture.mode, np.asarray(picture).astype(np.int64)


# --- the registry and the dataclasses ------------------------------------------------------------------------------
def test_kinds_are_declared_in_a_fixed_order_and_are_the_dataclasses_fields():
    assert [k.name for k in served_kinds.kinds()] == ["semantic", "panoptic", "segments", "language"]
    assert [k.name for k in served_kinds.kinds("instance")] == ["language"]
    assert [f.name for f in dataclasses.fields(Prediction)] == ["height", "width", "instances", "semantic",
                                                                "panoptic", "segments"]
    names = [f.name for f in dataclasses.fields(Instance)]
    assert names[names.index("text_score") + 1] == "language"  # where it always was: JSON keeps field order
    assert all(f.default is None for f in dataclasses.fields(Prediction) if f.name in ("semantic", "segments"))
    inst = Instance(score=0.5, label=1, language="zh")
    assert inst.language == "zh" and dataclasses.asdict(inst)["language"] == "zh"
    ids = np.zeros((2, 3), np.int32)
    p = Prediction(2, 3, [inst], semantic=ids)
    assert p.semantic is ids and p.panoptic is None and p.segments is None
    assert Prediction(2, 3, [], ids, ids, []).segments == []  # by position too, in the kinds' order
    assert [(k.name, k.column) for k in served_kinds.kinds()] == [
        ("semantic", "binary"), ("panoptic", "binary"), ("segments", "string"), ("language", None)]


def test_a_kind_registered_after_the_dataclasses_were_made_is_refused():
    late = ServedKind("late", "picture", "int | None", "too late")
    with pytest.raises(RuntimeError, match="before d2export.instances is imported"):
        served_kinds.register(late)
    assert "late" not in [k.name for k in served_kinds.kinds()]
    with pytest.raises(ValueError, match="per-picture"):
        ServedKind("odd", "instance", "int | None", "a file per detection", png=SEMANTIC.png)


# --- round trips ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top, mode", [(3, "L"), (255, "L"), (256, "I;16"), (65535, "I;16")])
def test_semantic_ids_round_trip_as_8_or_16_bit_greyscale(top, mode):
    ids = (np.arange(5 * 7).reshape(5, 7) * 7919) % (top + 1)
    ids[-1, -1] = top
    data = SEMANTIC.png.encode(ids.astype(np.int32))
    got_mode, got = pixels(data)
    assert got_mode == mode and (got == ids).all()
    back = SEMANTIC.png.decode(data)
    assert back.dtype == np.int32 and (back == ids).all()
    assert SEMANTIC.png.suffix == ".semantic.png" and SEMANTIC.to_json(ids) == {"shape": [5, 7]}
    with pytest.raises(ValueError, match="16-bit"):
        SEMANTIC.png.encode(np.array([[0, 70000]]))


def test_panoptic_ids_past_65535_round_trip_in_cocos_rgb():
    ids = np.array([[0, 1, 255, 256], [65535, 65536, 700000, (1 << 24) - 1]], np.int32)
    data = PANOPTIC.png.encode(ids)
    mode, rgb = pixels(data)
    assert mode == "RGB"
    # written out by hand: R the low byte, G the middle one, B the high one
    want = np.array([[[0, 0, 0], [1, 0, 0], [255, 0, 0], [0, 1, 0]],
                     [[255, 255, 0], [0, 0, 1], [700000 % 256, 700000 // 256 % 256, 700000 // 65536], [255] * 3]])
    assert (rgb == want).all()
    assert (PANOPTIC.png.decode(data) == ids).all() and PANOPTIC.png.suffix == ".panoptic.png"


def test_json_forms():
    segments = [Segment(1, 2, False), Segment(700, 1, True, "car")]
    assert SEGMENTS.to_json(segments) == [{"id": 1, "category_id": 2, "isthing": False},
                                          {"id": 700, "category_id": 1, "isthing": True, "class_name": "car"}]
    assert LANGUAGE.to_json("Latin") == "Latin" and LANGUAGE.png is None and LANGUAGE.column is None
    p = Prediction(2, 3, [Instance(0.5, 1, text="ab", text_score=0.9, language="Latin", box=[0.0, 0.0, 1.0, 1.0])],
                   semantic=np.ones((2, 3), np.int32), segments=segments)
    assert p.to_dict() == {"height": 2, "width": 3, "segments": SEGMENTS.to_json(segments),
                           "instances": [{"score": 0.5, "label": 1, "box": [0.0, 0.0, 1.0, 1.0], "text": "ab",
                                          "text_score": 0.9, "language": "Latin"}],
                           "semantic": {"shape": [2, 3]}}
    assert list(p.to_dict()) == ["height", "width", "instances", "semantic", "segments"]
    assert list(p.to_dict()["instances"][0]) == ["score", "label", "box", "text", "text_score", "language"]


def test_comparisons():
    a, b = np.zeros((10, 100), np.int32), np.zeros((10, 100), np.int32)
    assert SEMANTIC.compare(a, b) is None and SEMANTIC.compare(a, None) is None
    b[0, 0] = 1  # 0.1% of the pixels: not more than MAP_SHARE
    assert PANOPTIC.compare(a, b) is None
    b[0, 1] = 1
    assert PANOPTIC.compare(a, b) == (pytest.approx(20.0), "panoptic maps differ in 0.20% of their pixels")
    assert SEGMENTS.compare([Segment(1, 2, False)], [Segment(1, 2, True, "x")]) is None  # ids and classes only
    assert SEGMENTS.compare([Segment(1, 2, False)], None) == (CATEGORICAL, "panoptic segments 1 vs 0 (ids, classes)")
    assert LANGUAGE.compare is None  # its text is compared


def test_regions_panoptic_over_semantic():
    from test_runtime_maps import segmentation_prediction

    from d2export.runtime.visualize import _regions

    p = segmentation_prediction(8, 16)
    labels = [label for _, _, label in _regions(p, ["person", "car", "sky", "road", "grass"])]
    assert labels == ["sky", "road", "person", "car"]
    p.panoptic = None
    assert [label for _, _, label in _regions(p, None)] == ["0", "1", "2", "3", "4"]
    assert LANGUAGE.regions is None and SEGMENTS.regions is None


def test_detectron2_output_dict_round_trip():
    torch = pytest.importorskip("torch")
    semantic = np.array([[0, 2], [1, 2]], np.int32)
    panoptic = np.array([[0, 5], [5, 70000]], np.int32)
    segments = [Segment(5, 1, True, "b"), Segment(70000, 2, False, "c")]
    p = Prediction(2, 2, [], semantic, panoptic, segments)
    post = {"num_classes": 4, "class_names": ["a", "b", "c", "d"]}
    out = {}
    for kind in served_kinds.kinds("picture"):
        if kind.to_detectron2 is not None:
            out.update(kind.to_detectron2(p, post))
    assert list(out) == ["sem_seg", "panoptic_seg"] and out["sem_seg"].shape == (4, 2, 2)
    assert out["sem_seg"].dtype == torch.uint8 and (out["sem_seg"].argmax(0).numpy() == semantic).all()
    assert out["panoptic_seg"][1] == [{"id": 5, "category_id": 1, "isthing": True},
                                      {"id": 70000, "category_id": 2, "isthing": False}]
    back = {k.name: k.from_detectron2(out, post) for k in served_kinds.kinds("picture")}
    assert (back["semantic"] == semantic).all() and (back["panoptic"] == panoptic).all()
    assert back["segments"] == segments
    assert all(kind.to_detectron2(Prediction(2, 2), post) == {} for kind in (SEMANTIC, PANOPTIC))


# --- a new kind is one module --------------------------------------------------------------------------------------
NEW_KINDS = textwrap.dedent('''
    """Two kinds no model serves, declared as a module of d2export/served_kinds/ would declare them."""
    from d2export.served_kinds.declaration import CATEGORICAL, PngForm, ServedKind
    from d2export.served_kinds.pixel_maps import compare_maps, grey_png, read_ids, shape_json

    DEPTH = ServedKind("depth", "picture", "np.ndarray | None", "[H, W] millimetres to the camera",
                       to_json=shape_json, png=PngForm(lambda d: grey_png(d, "depths"), read_ids, ".depth.png"),
                       compare=compare_maps("depth"))
    ORIENTATION = ServedKind(
        "orientation", "instance", "float | None", "degrees", after="text_score",
        compare=lambda a, b: None if a == b else (CATEGORICAL, f"orientation {a} vs {b}"))
    KINDS = (DEPTH, ORIENTATION)
''')

PROBE = textwrap.dedent('''
    import base64, io, json, sys, tempfile
    from pathlib import Path
    from types import SimpleNamespace
    import numpy as np

    from d2export import served_kinds
    import new_kinds
    for kind in new_kinds.KINDS:  # what naming the module in served_kinds.MODULES does
        served_kinds.register(kind)

    from d2export.instances import Instance, Prediction
    from d2export.runtime import batch, infer, maps
    from d2export.served_kinds.pixel_maps import read_ids

    depth = (np.arange(6 * 9).reshape(6, 9) * 977 % 60000).astype(np.int32)
    inst = Instance(0.9, 1, box=[1.0, 2.0, 3.0, 4.0], text="ab", text_score=0.5, orientation=30.0)
    p = Prediction(6, 9, [inst], depth=depth)
    found = {"fields": list(p.to_dict()), "instance": list(p.to_dict()["instances"][0]),
             "to_dict": p.to_dict()["depth"], "orientation": p.to_dict()["instances"][0]["orientation"]}

    folder = Path(tempfile.mkdtemp())
    entries = infer.write_maps(p, folder, "pic")
    found["infer"] = {"has_maps": infer.has_maps(p), "entries": entries,
                      "same": bool((read_ids(Path(entries["depth"]["png"]).read_bytes()) == depth).all())}

    served = json.loads(json.dumps(maps.prediction_json(p)))
    found["served"] = {"keys": sorted(served["depth"]),
                       "same": bool((read_ids(base64.b64decode(served["depth"]["png_base64"])) == depth).all())}

    actor = batch.InferActor.__new__(batch.InferActor)
    actor.predictor = SimpleNamespace(predict_unpadded=lambda prepared: [p for _ in prepared])
    actor.maps = True
    rows = {"path": np.array(["a.png", "b.png"], dtype=object), "chw": np.array([None, None], dtype=object),
            "height": np.array([6, -1]), "width": np.array([9, -1]), "error": np.array(["", "unreadable"], dtype=object)}
    table = actor(rows)
    found["batch"] = {"columns": table.schema.names, "type": str(table.schema.field("depth").type),
                      "same": bool((read_ids(table.column("depth")[0].as_py()) == depth).all()),
                      "error_row": table.column("depth")[1].as_py(),
                      "instances": json.loads(table.column("instances")[0].as_py())[0]["orientation"]}

    from d2export.evaluating.runs import difference
    moved = depth.copy()
    moved[:2] += 1
    turned = Instance(0.9, 1, box=[1.0, 2.0, 3.0, 4.0], text="ab", text_score=0.5, orientation=40.0)
    found["evaluate"] = {"same": difference(p, Prediction(6, 9, [inst], depth=depth.copy())),
                         "depth": difference(p, Prediction(6, 9, [inst], depth=moved)),
                         "orientation": difference(p, Prediction(6, 9, [turned], depth=depth))}
    print(json.dumps(found))
''')


def test_a_kind_declared_in_one_module_reaches_every_place(tmp_path):
    """The proof issue 94 asks for: a per-picture depth map and a per-instance orientation, declared in one module
    and registered before d2export.instances is imported (as the registry does for its own), in a fresh interpreter
    (nothing to unregister here: this process never sees them)."""
    (tmp_path / "new_kinds.py").write_text(NEW_KINDS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["fields"] == ["height", "width", "instances", "depth"]
    assert found["instance"] == ["score", "label", "box", "text", "text_score", "orientation"]
    assert found["to_dict"] == {"shape": [6, 9]} and found["orientation"] == 30.0
    assert found["infer"]["has_maps"] and found["infer"]["same"]
    assert found["infer"]["entries"]["depth"]["shape"] == [6, 9]
    assert found["infer"]["entries"]["depth"]["png"].endswith("pic.depth.png")
    assert found["served"] == {"keys": ["png_base64", "shape"], "same": True}
    assert found["batch"]["columns"] == ["path", "height", "width", "instances", "error", "semantic", "panoptic",
                                         "segments", "depth"]
    assert found["batch"]["type"] == "binary" and found["batch"]["same"] and found["batch"]["error_row"] is None
    assert found["batch"]["instances"] == 30.0
    assert found["evaluate"]["same"] is None
    assert found["evaluate"]["depth"] == [pytest.approx(1e4 * 18 / 54), "depth maps differ in 33.33% of their pixels"]
    assert found["evaluate"]["orientation"] == [CATEGORICAL, "orientation 30.0 vs 40.0"]
    assert "depth" not in [k.name for k in served_kinds.kinds()]  # this process: untouched


# --- DeepSolo++'s language -----------------------------------------------------------------------------------------
def test_deepsolo_plus_serves_each_instances_language():
    """DeepSolo++'s post-processing (the family's own, on synthetic graph outputs): each instance's script from the
    `languages` output, its text read with that script's characters, the language in its JSON after `text_score`."""
    from d2export.families import get
    from d2export.runtime.maps import prediction_json

    k, points, slots = 3, 4, 3
    rng = np.random.default_rng(0)
    outputs = {"scores": np.array([[0.9, 0.2, 0.8]], np.float32), "labels": np.zeros((1, k), np.int64),
               "ctrl_points": rng.uniform(0, 50, (1, k, points, 2)).astype(np.float32),
               "bd_points": rng.uniform(0, 50, (1, k, points, 4)).astype(np.float32),
               "char_ids": np.array([[[1, 2, 9], [1, 1, 1], [2, 1, 9]]], np.int64),
               "char_scores": np.full((1, k, slots), 0.5, np.float32), "languages": np.array([[0, 0, 1]], np.int64)}
    post = {"points": "centre_line", "languages": ["Latin", "Symbols"],
            "charsets": {"Latin": ["a", "b", "c"], "Symbols": ["#", "$", "%"]}}
    prediction = get("deepsolo_plus").prediction(outputs, 0, (50, 50), (100, 100), post, 0.5)
    assert [(i.language, i.text) for i in prediction.instances] == [("Latin", "bc"), ("Symbols", "%$")]
    lines = prediction.to_dict()["instances"]
    assert [line["language"] for line in lines] == ["Latin", "Symbols"]
    keys = list(lines[0])
    assert keys[keys.index("text_score") + 1] == "language"
    assert prediction_json(prediction) == prediction.to_dict()  # nothing but instances: no maps
