"""The segmenter fixture (tests/data/segmenter_fixture.pth, configs/mask2former_fixture.yaml): the tiny Mask2Former
trained on `d2export synth boxes --segmentation`, which really segments: exported, verified, served and scored against
ground truth, its things and stuff the synthetic sets'."""
import hashlib
import json
from pathlib import Path

import pytest

from d2export.datasets import generate
from exports import export

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "segmenter_fixture.pth"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("segmenter")
    return out, export("mask2former_fixture", out, "export.lint=false")


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Pictures the fixture never saw: a seed of their own (training 30, held-out 31 and the int8 figures' 32-33)."""
    return generate("boxes", tmp_path_factory.mktemp("held_out") / "segments", count=8, seed=37, size=(160, 160),
                    workers=1, segmentation=True)


def test_the_fixture_is_what_its_record_says():
    record = json.loads(FIXTURE.with_suffix(".json").read_text())
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == record["sha256"]
    assert FIXTURE.stat().st_size == record["bytes"] <= 10 * 2**20
    assert record["command"].startswith("python training/train_segmenter_fixture.py")
    assert record["held_out"]["seed"] == 31 and record["train"]["seed"] == 30


def test_export_verifies_with_the_trained_weights_and_the_synthetic_classes(exported):
    _, manifest = exported
    assert manifest.verification["passed"] is True and manifest.family == "mask2former"
    assert manifest.weights["path"].endswith("segmenter_fixture.pth") and not manifest.weights["missing"]
    post = manifest.postprocess
    # the synthetic sets' classes (d2export/datasets/boxes.py), read from the metadata the config names
    assert post["class_names"] == ["ellipse", "triangle", "rectangle", "star", "cross", "bar", "background"]
    assert post["thing_ids"] == [0, 1, 2, 3, 4]


def test_what_it_serves_scores_on_pictures_it_never_saw(exported, held_out):
    """Scored by the segmentation evaluator against the pictures' own labels, served through the runtime: a floor
    well under the record's held-out figures (seed 31, 200 pictures), far above seeded weights' (mIoU near 0)."""
    from d2export.evaluating.evaluate import evaluate

    out, manifest = exported
    record = json.loads(FIXTURE.with_suffix(".json").read_text())["held_out"]
    report = evaluate([str(out)], dataset=str(held_out), threads=2)
    metrics = report["runs"][0]["metrics"]
    assert metrics["sem_seg/mIoU"] >= 0.6 * record["mIoU"]
    assert metrics["panoptic_seg/PQ"] >= 0.6 * record["PQ"]
