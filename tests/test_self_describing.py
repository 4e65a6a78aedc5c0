"""export.fp16, verified with its own tolerances; models that carry their manifest
in metadata_props (a lone model.onnx serves); manifests validated against the schema when read."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from d2export.verification.comparison import Reduced, compare_reduced_case, match_slots, top_k_agreement
from d2export.resizing import synthetic_image
from d2export.manifest import METADATA_KEY, Manifest, manifest_path
from d2export.runtime import Predictor


@pytest.fixture(scope="module")
def fp16_export(tmp_path_factory):
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("fp16")
    cfg = load("textdet_tiny", [f"export.output_dir={out}", "export.fp16=true", "export.keep_io_types=false",
                                "export.lint=false", "verify.sizes=[[160,224],[200,136]]", "verify.batch=false"])
    manifest = pipeline.export(cfg)
    return manifest, out / manifest.model_file


def test_fp16_export_is_float16_verified_and_recorded(fp16_export):
    manifest, path = fp16_export
    model = onnx.load(str(path))
    weights = [t for t in model.graph.initializer if len(t.dims) >= 2]
    assert sum(t.data_type == TensorProto.FLOAT16 for t in weights) > 0.9 * len(weights)
    # keep_io_types=false: float outputs are float16 in the graph
    assert TensorProto.FLOAT16 in {o.type.tensor_type.elem_type for o in model.graph.output}
    assert any(n.op_type == "Softmax" for n in model.graph.node)
    producers = {o: n for n in model.graph.node for o in n.output}
    types = {v.name: v.type.tensor_type.elem_type
             for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    for n in model.graph.node:
        if n.op_type == "Softmax":  # Softmax computes in float32
            assert types.get(n.input[0]) == TensorProto.FLOAT or producers[n.input[0]].op_type == "Cast"
    assert manifest.precision == "float16"
    v = manifest.verification["fp16"]
    assert v["passed"] and v["top_k_agreement"] >= v["min_top_k_agreement"] and v["cases"]
    assert manifest.verification["passed"]  # the float32 graph was verified first, at float32's tolerance
    assert Manifest.read(manifest_path(path)).precision == "float16"


def test_predictor_serves_fp16_like_the_float32_graph(fp16_export, tiny_export):
    _, half_path = fp16_export
    full, half = Predictor(tiny_export[2], threads=1), Predictor(half_path, threads=1)
    rng = np.random.default_rng(3)
    for h, w in [(150, 230), (260, 140)]:
        image = synthetic_image(h, w, seed=int(rng.integers(1000))).transpose(1, 2, 0)
        a, b = full.predict(image, score_threshold=0.0), half.predict(image, score_threshold=0.0)
        assert len(a.instances) == len(b.instances) > 0
        sa = np.array([i.score for i in a.instances])
        sb = np.array([i.score for i in b.instances])
        assert np.abs(np.sort(sa) - np.sort(sb)).max() < 0.05


def test_top_k_agreement_counts_shared_detections():
    e = np.array([[0.9, 0.8, 0.1, 0.05], [0.1, 0.2, 0.3, 0.4]])
    assert top_k_agreement(e, e, 2) == 1.0
    swapped = np.array([[0.8, 0.9, 0.1, 0.05], [0.1, 0.2, 0.4, 0.3]])  # order within the top-2 changes: agreed
    assert top_k_agreement(e, swapped, 2) == 1.0
    lost = np.array([[0.9, 0.0, 0.85, 0.05], [0.1, 0.2, 0.3, 0.4]])  # one of row 0's top-2 replaced
    assert top_k_agreement(e, lost, 2) == 0.5


def test_slots_are_matched_by_content_not_position():
    rng = np.random.default_rng(0)
    n, k = 2, 6
    expected = {"scores": rng.uniform(0.4, 0.6, (n, k)).astype(np.float32),
                "boxes": rng.uniform(0, 300, (n, k, 4)).astype(np.float32),
                "ids": rng.integers(0, 9, (n, k, 3))}
    perm = np.stack([rng.permutation(k) for _ in range(n)])  # actual slot j holds expected slot perm[j]
    noise = lambda x: x + rng.normal(0, 1e-3, x.shape).astype(x.dtype) if x.dtype.kind == "f" else x  # noqa: E731
    actual = {name: noise(np.take_along_axis(v, perm.reshape(perm.shape + (1,) * (v.ndim - 2)), axis=1))
              for name, v in expected.items()}
    order = match_slots(expected, actual, "scores")
    for row in range(n):  # expected slot i is found where the permutation put it
        assert [int(perm[row, order[row, i]]) for i in range(k)] == list(range(k))
    assert top_k_agreement(expected["scores"], actual["scores"], 3, order) == 1.0
    assert top_k_agreement(expected["scores"], actual["scores"], k) == 1.0  # all k: any order agrees


def test_a_detection_is_matched_to_one_of_its_own_class():
    """Two classes' detections of one object: nearly the same box, scores alike. Float16 noise trades their scores;
    by boxes and scores alone each would pair with the other class's detection and the labels would disagree."""
    box = np.array([40.0, 60.0, 140.0, 120.0], np.float32)
    expected = {"boxes": np.stack([box, box + 0.5, box + 150])[None],
                "scores": np.array([[0.300, 0.290, 0.2]], np.float32), "labels": np.array([[1, 2, 0]])}
    actual = {"boxes": expected["boxes"].copy(), "scores": np.array([[0.291, 0.301, 0.2]], np.float32),
              "labels": expected["labels"].copy()}
    assert match_slots(expected, actual, "scores").tolist() == [[0, 1, 2]]
    floats_only = {k: v for k, v in expected.items() if k != "labels"}
    assert match_slots(floats_only, actual, "scores").tolist() == [[1, 0, 2]]  # what it did before ids counted


BOXES = {"boxes": "pixels", "scores": "probabilities", "labels": "ids"}


def _f16(max_mismatch):
    return Reduced("float16", 0.05, 0.05, 1.0, 2e-3, max_mismatch, confident=0.3, top_k=2)


def _detections(scores, boxes, labels):
    return {"boxes": np.asarray(boxes, np.float32)[None], "scores": np.asarray(scores, np.float32)[None],
            "labels": np.asarray(labels, np.int64)[None]}


def test_a_detection_at_the_lists_cut_may_come_and_go_but_no_other():
    """A list keeps its K best detections: one scoring within the score tolerance of the other list's lowest may
    drop out under float16 noise, and another takes its slot. Any other missing or changed detection is refused."""
    boxes = [[10, 10, 60, 60], [100, 20, 180, 90], [30, 200, 90, 260], [200, 200, 260, 280]]
    elsewhere = [250, 10, 300, 50]  # a detection the other list does not have

    def verdict(expected, actual):
        compared, agreement = compare_reduced_case("case", expected, actual, _f16(0.0), BOXES)
        return all(c.ok for c in compared) and agreement == 1.0, compared[0].at_cut

    expected = _detections([0.9, 0.6, 0.031, 0.030], boxes, [0, 1, 2, 3])
    assert verdict(expected, {k: v.copy() for k, v in expected.items()}) == (True, 0)
    tail_swapped = _detections([0.9, 0.6, 0.031, 0.029], boxes[:3] + [elsewhere], [0, 1, 2, 4])
    assert verdict(expected, tail_swapped) == (True, 1)
    # refused: a detection scoring 0.2 over a cut at 0.03 is lost; one above the cut moved; labels or boxes changed
    clear = _detections([0.9, 0.6, 0.2, 0.030], boxes, [0, 1, 2, 3])
    assert verdict(clear, _detections([0.9, 0.6, 0.031, 0.030], boxes[:2] + [elsewhere, boxes[3]], [0, 1, 4, 3])) \
        == (False, 0)
    moved = _detections([0.9, 0.6, 0.031, 0.030], [boxes[0], elsewhere] + boxes[2:], [0, 1, 2, 3])
    assert verdict(expected, moved)[0] is False
    relabelled = _detections([0.9, 0.6, 0.031, 0.030], boxes, [1, 2, 3, 4])
    assert verdict(expected, relabelled) == (False, 2)  # the two at the cut are excused, the two above are not
    shifted = _detections([0.9, 0.6, 0.031, 0.030], np.asarray(boxes) + [30, 0, 30, 0], [0, 1, 2, 3])
    assert verdict(expected, shifted)[0] is False
    assert verdict(expected, tail_swapped | {"scores": tail_swapped["scores"][:, :3]}) == (False, 0)  # wrong layout


def test_pairs_left_out_at_the_cut_do_not_dilute_the_rest():
    """A list of 50 whose tail (48 detections under 0.05) lies within the score tolerance of its cut: shifting every
    box 30 px leaves 4 wrong elements of 200 (2%, under a 5% allowance) but 4 of the 8 compared once the tail is
    left out. Refused; the same list with its whole tail swapped for other detections passes."""
    rng = np.random.default_rng(0)
    corner = rng.uniform(0, 300, (50, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(20, 80, (50, 2))], axis=1)
    scores = np.concatenate([[0.9, 0.6], np.linspace(0.03, 0.01, 48)])
    expected = _detections(scores, boxes, np.arange(50) % 5)

    def verdict(actual):
        compared, agreement = compare_reduced_case("case", expected, actual, _f16(0.05), BOXES)
        return all(c.ok for c in compared) and agreement == 1.0, compared[0].at_cut

    other_tail = np.concatenate([boxes[:2], boxes[2:] + 1000])  # far from any of the expected
    assert verdict(_detections(scores, other_tail, np.arange(50) % 5)) == (True, 48)
    assert verdict(_detections(scores, boxes + [30, 0, 30, 0], np.arange(50) % 5)) == (False, 48)


def test_a_lone_model_serves_from_its_metadata(tiny_export, tmp_path):
    _, manifest, path = tiny_export
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    embedded = json.loads(props[METADATA_KEY])
    assert embedded["family"] == manifest.family == props["d2export.family"]
    assert embedded["preprocess"] == manifest.preprocess and embedded["postprocess"] == manifest.postprocess
    assert "charset" in json.dumps(embedded["postprocess"]) or embedded["postprocess"]
    assert embedded["schema_version"] == manifest.schema_version and embedded["versions"]["d2export"]
    lone = tmp_path / "alone.onnx"
    shutil.copy(path, lone)
    assert not manifest_path(lone).exists()
    served, reference = Predictor(lone, threads=1, embedded_manifest=True), Predictor(path, threads=1)
    assert served.manifest.family == manifest.family
    assert served.manifest.outputs == manifest.outputs and served.manifest.inputs == manifest.inputs
    docs = {t.name: t.doc for t in served.manifest.inputs + served.manifest.outputs}
    assert all(docs.values()), docs  # every input and output says what it holds, inside the model too
    assert "pixels" in docs["ctrl_points"] and "charset" in docs["char_ids"] and "padding" in docs["image_sizes"]
    assert served.min_size == reference.min_size and served.post == reference.post
    image = synthetic_image(170, 240, seed=5).transpose(1, 2, 0)
    assert served.predict(image).to_dict() == reference.predict(image).to_dict()


def test_infer_serves_a_lone_model_when_asked(tiny_export, tmp_path, capsys):
    from PIL import Image

    from d2export.cli import main

    lone, picture = tmp_path / "alone.onnx", tmp_path / "one.png"
    shutil.copy(tiny_export[2], lone)
    Image.fromarray(synthetic_image(100, 140, seed=5).transpose(1, 2, 0)).save(picture)
    assert main(["infer", str(lone), str(picture), "--threads", "1"]) == 2  # refused: an interrupted export's leftover
    assert "manifest" in capsys.readouterr().err
    assert main(["infer", str(tiny_export[2]), str(picture), "--threads", "1", "--score-threshold", "0"]) == 0
    beside = json.loads(capsys.readouterr().out)["instances"]
    assert main(["infer", str(lone), str(picture), "--threads", "1", "--score-threshold", "0",
                 "--embedded-manifest"]) == 0
    assert json.loads(capsys.readouterr().out)["instances"] == beside and beside


def test_a_model_without_metadata_or_manifest_is_one_line(tmp_path):
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "plain.onnx"))
    with pytest.raises(ValueError, match="no manifest beside it"):
        Predictor(tmp_path / "plain.onnx", embedded_manifest=True)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("family"), "family"),
    (lambda d: d.update(opset="seventeen"), "opset"),
    (lambda d: d["inputs"][0].update(shape="NCHW"), "inputs.0.shape"),
    (lambda d: d.update(preprocess=[1, 2]), "preprocess"),
])
def test_manifest_is_validated_when_read(tiny_export, tmp_path, edit, says):
    d = json.loads(manifest_path(tiny_export[2]).read_text())
    edit(d)
    bad = tmp_path / "bad.manifest.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"manifest does not match its schema: {says}"):
        Manifest.read(bad)
