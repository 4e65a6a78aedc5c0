"""The box fixture (tests/data/box_fixture.pth): a small Cascade R-CNN trained on synthetic shapes that really
detects — exported, verified, served and evaluated with figures that mean something."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from d2export.datasets import generate
from exports import export

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "box_fixture.pth"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("boxdet")
    manifest = export("boxdet", out)
    return out, manifest


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Pictures the fixture never saw: another seed than its training (0) and held-out (1) sets."""
    return generate("boxes", tmp_path_factory.mktemp("held_out") / "boxes", count=8, seed=7, size=(320, 320),
                    workers=1)


def test_the_fixture_is_what_its_record_says():
    record = json.loads(FIXTURE.with_suffix(".json").read_text())
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == record["sha256"]
    assert FIXTURE.stat().st_size == record["bytes"] <= 10 * 2**20
    assert record["bbox"]["AP"] >= 50 and record["command"].startswith("python training/train_box_fixture.py")


def test_export_verifies_with_the_trained_weights(exported):
    _, manifest = exported
    assert manifest.verification["passed"] is True and manifest.family == "rcnn"
    assert manifest.weights["path"].endswith("box_fixture.pth") and not manifest.weights["missing"]
    assert manifest.weights.get("kind") != "seeded"


@pytest.fixture(scope="module")
def float16(tmp_path_factory):
    """The fixture exported in float16, and the eager references of its verification cases."""
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("boxdet_fp16")
    cfg = load("boxdet", [f"export.output_dir={out}", "export.fp16=true"])
    built = pipeline.prepare(cfg)
    manifest = pipeline.export(cfg, built=built)
    return manifest, out / manifest.model_file, built, pipeline.verification_cases(built)


def test_float16_export_verifies_detection_by_detection(float16):
    """Float16 reorders this model's near-tied tail (per-class detections of one proposal score alike); it verified
    only once detections were matched with their labels (before: labels differed in 8% and 20% of slots). At AP 66,
    float16 also makes the RPN's TopK and NMS pick other near-equal proposals on two cases (boxes 223 and 153 px
    apart): those pass once the graph's picks are pinned. At AP 74 it changes which of the tail's near-equal scores
    (0.0003 to 0.05) make the 50-slot cut: 2 or 3 such pairs a case are left out as come-and-go at the cut."""
    manifest = float16[0]
    fp16 = manifest.verification["fp16"]
    assert manifest.precision == "float16" and fp16["passed"] is True
    assert fp16["providers"] == ["CPUExecutionProvider"]  # what the figures held on
    assert all(p["ok"] for p in fp16.get("pinned", []))


def test_float16_verification_still_refuses_wrong_detections(float16):
    """Each case verifies, as it is or with its near-tied selections pinned; detections made wrong after the graph
    (a class mix-up, each box on its neighbour's slot, boxes shifted 30 px) are refused either way."""
    import onnxruntime as ort

    from d2export import pipeline
    from d2export.verification import near_ties, pinning
    from d2export.verification.comparison import compare_reduced_case

    _, path, built, cases = float16
    v, names = built.cfg.verify, built.adapter.output_names
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    selecting, nodes = near_ties.selecting_session(path)
    outputs = [o.name for o in selecting.get_outputs()]
    tolerances = pinning.Tolerances(v.fp16_atol, v.fp16_rtol, v.fp16_atol, v.fp16_max_mismatch)

    tol = pipeline.reduced_tolerances(built.cfg)

    def verdict(expected, actual):
        compared, agreement = compare_reduced_case("case", expected, actual, tol, built.family.output_kinds)
        return all(c.ok for c in compared) and agreement >= v.min_top_k_agreement

    wrongs = {"right": lambda a: a, "relabelled": lambda a: a | {"labels": (a["labels"] + 1) % 5},
              "boxes of others": lambda a: a | {"boxes": np.roll(a["boxes"], 1, axis=1)},
              "shifted": lambda a: a | {"boxes": a["boxes"] + np.array([30.0, 0, 30.0, 0], np.float32)}}
    for case in cases:
        expected, actual = dict(zip(names, case.expected)), dict(zip(names, session.run(names, case.inputs)))
        for name, wrong in wrongs.items():
            judge = lambda _, e, a: ([], verdict(e, wrong(a)))  # noqa: E731 - the graph's outputs made wrong
            pinned = pinning.pin_case(case, selecting, nodes, outputs, names, lambda c: built.adapter.reference(
                c.images), judge, tolerances)
            passed = verdict(expected, wrong(actual)) or pinned.ok
            assert passed == (name == "right"), (case.name, name, pinned.why)


def iou(a, b):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_the_served_model_finds_the_shapes(exported, held_out):
    from d2export.runtime.image_decoding import read_image
    from d2export.runtime.predictor import Predictor

    out, manifest = exported
    predictor = Predictor(out / manifest.model_file)
    coco = json.loads((held_out / "annotations.json").read_text())
    shapes = matched = kept = stray = 0
    for image in coco["images"]:
        truth = [xyxy(a["bbox"]) + [a["category_id"] - 1, a["area"]] for a in coco["annotations"]
                 if a["image_id"] == image["id"]]
        detections = [d for d in predictor.predict(read_image(held_out / "images" / image["file_name"])).instances
                      if d.score >= 0.5]
        for *box, label, area in truth:
            if area >= 400:  # a shape mostly hidden is not required
                shapes += 1
                matched += any(d.label == label and iou(d.box, box) >= 0.5 for d in detections)
        kept += len(detections)
        stray += sum(not any(iou(d.box, t[:4]) >= 0.5 for t in truth) for d in detections)
    # a seeded model finds none; the fixture (held-out AP 81) finds most, with few confident strays
    assert shapes >= 10 and matched / shapes >= 0.6, f"{matched} of {shapes} shapes found with their class"
    assert stray <= 0.25 * kept, f"{stray} of {kept} confident detections lie on no shape"


def xyxy(box):
    x, y, w, h = box
    return [x, y, x + w, y + h]


def test_evaluate_keeps_the_accuracy(exported, held_out):
    from d2export.evaluating.evaluate import evaluate

    out, _ = exported
    report = evaluate([str(out)], dataset=str(held_out), config="boxdet")
    torch_run, onnx_run = report["runs"]
    print(f"held-out AP: PyTorch {torch_run['metrics']['bbox/AP']:.2f}, ONNX {onnx_run['metrics']['bbox/AP']:.2f}")
    # the record's held-out AP (300 pictures of seed 1: 80.88) minus the noise of 8 pictures (80.22 here): the
    # fixture's earlier checkpoints (AP 66, 74) would fail
    record = json.loads(FIXTURE.with_suffix(".json").read_text())
    assert torch_run["metrics"]["bbox/AP"] >= record["bbox"]["AP"] - 5
    assert abs(onnx_run["metrics"]["bbox/AP"] - torch_run["metrics"]["bbox/AP"]) <= 0.1
    assert report["comparisons"][0]["differing_pictures"] <= 1


def test_the_built_model_keeps_its_own_score_threshold():
    """Export runs the detector at threshold 0 inside its adapter only: the model itself answers as the user's."""
    import torch

    from d2export import pipeline
    from d2export.config import load

    built = pipeline.prepare(load("boxdet", ["export.output_dir=unused"]))
    predictors = built.model.roi_heads.box_predictor  # one a cascade stage
    assert len(predictors) == 3 and {p.test_score_thresh for p in predictors} == {0.01}
    from d2export.datasets import draw

    picture = np.ascontiguousarray(draw("boxes", 7, 0, 320, 320)[0][:, :, ::-1].transpose(2, 0, 1))  # BGR, CHW
    with torch.no_grad():
        scores = built.model([{"image": torch.from_numpy(picture).float()}])[0]["instances"].scores
        everything = built.adapter.reference([picture])[built.adapter.output_names.index("scores")][0]
    assert len(scores) > 0 and (scores > 0.01).all()
    assert (everything <= 0.01).any() and len(everything) > len(scores)  # the adapter's run keeps low scores
    assert {p.test_score_thresh for p in predictors} == {0.01}


def test_the_training_script_records_what_it_made_and_resumes(tmp_path):
    """Two steps on a handful of tiny pictures (the recipe's plumbing, not training): the weights, their record and
    the command; run again, it starts from its last checkpoint instead of training anew."""
    import subprocess
    import sys

    import torch

    fixture = tmp_path / "fixture.pth"
    args = [sys.executable, str(REPO / "training" / "train_box_fixture.py"), "--out", str(tmp_path / "run"), "--iters",
            "2", "--train-count", "4", "--held-out-count", "2", "--size", "96x96", "--fixture", str(fixture),
            "--decay-at", "0.5", "--bf16", "SOLVER.IMS_PER_BATCH", "2", "MODEL.ROI_BOX_HEAD.FC_DIM", "32"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(fixture.with_suffix(".json").read_text())
    assert record["sha256"] == hashlib.sha256(fixture.read_bytes()).hexdigest()
    assert record["command"].endswith("FC_DIM 32") and record["iterations"] == 2
    assert record["precision"] == "bfloat16 autocast"
    weights = torch.load(fixture, weights_only=False)["model"]
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float16}
    assert weights["roi_heads.box_head.0.fc1.weight"].shape[0] == 32  # the override reached the config
    assert weights["roi_heads.box_predictor.2.bbox_pred.weight"].shape[0] == 4  # the recipe's: 3 stages, agnostic
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "Starting training from iteration 0" in log and "Starting training from iteration 2" in log
