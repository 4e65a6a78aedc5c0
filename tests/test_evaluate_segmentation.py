"""Segmentation in `d2export evaluate`: panoptic quality counted as COCO panoptic defines it on hand-built cases, the
box set's per-pixel labels (`d2export synth boxes --segmentation`) scoring 100 against themselves, and a seeded
Mask2Former scored under PyTorch and as its exported graph with equal figures (mIoU, PQ, mask AP)."""
import json
import math

import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog, MetadataCatalog
from PIL import Image

from d2export.datasets import generate, register
from d2export.evaluating import panoptic_quality as pq
from d2export.evaluating.convert import prediction_of, to_outputs
from d2export.evaluating.evaluators import SegmentationEvaluator
from d2export.evaluating.runs import difference
from d2export.instances import Instance, Prediction, Segment, encode_mask

SIZE = (128, 96)
NAME = "synth_segmentation_eval"
# the stand-in Mask2Former with the box set's 7 classes and metadata (as one trained on it would be); seed 3's random
# head calls the background stuff everywhere, so PQ and mIoU have something to count
OPTS = ["model.opts=[MODEL.SEM_SEG_HEAD.NUM_CLASSES,7,DATASETS.TRAIN,\"('synth_segmentation_eval',)\","
        "TEST.DETECTIONS_PER_IMAGE,20]", "model.seed=3"]
FAST = ["verify.sizes=[[96,128]]", "verify.batch=false", "export.lint=false"]


# --- panoptic quality by hand -------------------------------------------------------------------------------------
THING, OTHER_THING, STUFF, OTHER_STUFF = 0, 1, 5, 6
CATEGORIES = {THING: True, OTHER_THING: True, STUFF: False, OTHER_STUFF: False}


def seg(sid, category, crowd=0):
    return {"id": sid, "category_id": category, "iscrowd": crowd}


def columns(spans, width=30, height=10):
    """A [height, width] id map from {id: (first column, last column + 1)}; other columns 0."""
    ids = np.zeros((height, width), np.int64)
    for sid, (a, b) in spans.items():
        ids[:, a:b] = sid
    return ids


def scored(truth, truth_segments, found, found_segments):
    return pq.summary(pq.count(truth, truth_segments, found, found_segments), CATEGORIES)


def test_a_perfect_prediction_scores_100():
    truth = columns({1: (0, 10), 2: (12, 15), 3: (15, 30)})  # columns 10-11 void
    segments = [seg(1, THING), seg(2, THING), seg(3, STUFF)]
    got = scored(truth, segments, truth, segments)
    assert got == {f"{m}{s}": 100.0 for s in ("", "_th", "_st") for m in ("PQ", "SQ", "RQ")}


def test_a_thing_half_overlapping_is_a_miss_and_a_false_positive():
    truth = columns({1: (0, 10), 2: (10, 30)})  # a thing of 100 pixels, stuff of 200
    found = columns({9: (0, 30), 7: (5, 15)})  # the thing 5 columns right: IoU 50 / 150
    got = scored(truth, [seg(1, THING), seg(2, STUFF)], found, [seg(7, THING), seg(9, STUFF)])
    # the thing: FN + FP, 0; the stuff: IoU 150 / 250 = 0.6, matched
    assert got["PQ_th"] == got["SQ_th"] == got["RQ_th"] == 0.0
    assert (got["PQ_st"], got["SQ_st"], got["RQ_st"]) == pytest.approx((60.0, 60.0, 100.0))
    assert (got["PQ"], got["SQ"], got["RQ"]) == pytest.approx((30.0, 30.0, 50.0))
    stats = pq.count(truth, [seg(1, THING), seg(2, STUFF)], found, [seg(7, THING), seg(9, STUFF)])
    assert (stats[THING].tp, stats[THING].fp, stats[THING].fn) == (0, 1, 1)


def test_a_stuff_region_split_in_two_matches_once():
    truth = columns({1: (0, 10), 2: (10, 30)})
    found = columns({1: (0, 10), 4: (10, 22), 5: (22, 30)})  # the stuff as 120 + 80 pixels, both its class
    got = scored(truth, [seg(1, THING), seg(2, STUFF)], found, [seg(1, THING), seg(4, STUFF), seg(5, STUFF)])
    # the stuff: TP at IoU 0.6 and an FP → PQ 0.6 / 1.5, SQ 0.6, RQ 1 / 1.5; the thing perfect
    assert (got["PQ_st"], got["SQ_st"], got["RQ_st"]) == pytest.approx((40.0, 60.0, 200 / 3))
    assert (got["PQ"], got["SQ"], got["RQ"]) == pytest.approx((70.0, 80.0, (100 + 200 / 3) / 2))
    # split between two classes: the other class's part is its false positive
    other = scored(truth, [seg(1, THING), seg(2, STUFF)], found, [seg(1, THING), seg(4, STUFF),
                                                                  seg(5, OTHER_STUFF)])
    assert (other["PQ_st"], other["SQ_st"], other["RQ_st"]) == pytest.approx((30.0, 30.0, 50.0))


def test_void_pixels_are_ignored():
    truth = columns({1: (0, 10), 3: (20, 40)}, width=40)  # columns 10-19 void
    segments = [seg(1, THING), seg(3, STUFF)]
    found_segments = [seg(1, THING), seg(2, OTHER_THING), seg(3, STUFF)]
    found = columns({1: (0, 15), 2: (15, 20), 3: (20, 40)}, width=40)  # the thing spills onto void; another lies on it
    got = scored(truth, segments, found, found_segments)
    assert got == {k: 100.0 for k in got}
    # that other one on 30 void and 60 labelled pixels: a false positive; the stuff left with 140 of its 200
    found = columns({1: (0, 15), 2: (17, 26), 3: (26, 40)}, width=40)
    got = scored(truth, segments, found, found_segments)
    assert got["RQ_th"] == pytest.approx((100 + 0) / 2) and got["SQ_th"] == 50.0 and got["SQ_st"] == pytest.approx(70.0)


def test_crowd_regions_are_neither_missed_nor_found_by_their_own_class():
    truth = columns({1: (0, 10), 2: (10, 20), 3: (20, 30)})
    segments = [seg(1, THING), seg(2, THING, crowd=1), seg(3, STUFF)]
    found = columns({1: (0, 10), 5: (10, 20), 3: (20, 30)})
    assert scored(truth, segments, found, [seg(1, THING), seg(5, THING), seg(3, STUFF)])["PQ"] == 100.0
    other = scored(truth, segments, found, [seg(1, THING), seg(5, OTHER_THING), seg(3, STUFF)])
    assert other["RQ_th"] == pytest.approx(50.0)  # another class on the crowd: its false positive


def test_nothing_to_count_is_nan_and_a_stray_id_is_refused():
    truth = columns({1: (0, 30)})
    got = scored(truth, [seg(1, STUFF)], truth, [seg(1, STUFF)])
    assert got["PQ_st"] == 100.0 and math.isnan(got["PQ_th"])
    with pytest.raises(ValueError, match=r"segment ids \[2\]"):
        pq.count(truth, [seg(1, STUFF)], truth * 2, [seg(1, STUFF)])


# --- the box set's per-pixel labels ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    folder = generate("boxes", tmp_path_factory.mktemp("seg") / "boxes", count=4, seed=2, size=SIZE, workers=1,
                      segmentation=True)
    register(NAME, folder)
    yield folder
    DatasetCatalog.remove(NAME)
    MetadataCatalog.remove(NAME)


def test_the_box_set_labels_every_pixel_consistently(labelled, tmp_path):
    panoptic = json.loads((labelled / "panoptic.json").read_text())
    coco = json.loads((labelled / "annotations.json").read_text())
    assert [(c["name"], c["isthing"]) for c in panoptic["categories"]][-2:] == [("bar", 0), ("background", 0)]
    contiguous = {c["id"]: i for i, c in enumerate(panoptic["categories"])}
    for image, ann in zip(panoptic["images"], panoptic["annotations"]):
        ids = pq.rgb_to_id(np.asarray(Image.open(labelled / "panoptic" / ann["file_name"])))
        semantic = np.asarray(Image.open(labelled / "semantic" / ann["file_name"]))
        assert ids.shape == semantic.shape == (image["height"], image["width"])
        assert set(np.unique(ids)) - {0} == {s["id"] for s in ann["segments_info"]}
        for s in ann["segments_info"]:
            assert s["area"] == (ids == s["id"]).sum()
            assert (semantic[ids == s["id"]] == contiguous[s["category_id"]]).all()
        assert (semantic[ids == 0] == 255).all()
        things = [s for s in ann["segments_info"] if contiguous[s["category_id"]] < 5]
        assert len(things) == sum(a["image_id"] == image["id"] for a in coco["annotations"])
    meta = MetadataCatalog.get(NAME)
    assert meta.stuff_classes[-2:] == ["bar", "background"] and meta.ignore_label == 255
    assert meta.thing_dataset_id_to_contiguous_id == {i: i - 1 for i in range(1, 6)}
    with pytest.raises(ValueError, match="text set has no per-pixel labels"):
        generate("text", tmp_path / "text", count=1, size=SIZE, segmentation=True)


def truth_outputs(record):
    """A record's own ground truth as a segmenter's outputs: scores 1 on the labelled class, masks from polygons."""
    from detectron2.structures import Instances
    from pycocotools import mask as mask_util

    h, w = record["height"], record["width"]
    semantic = torch.as_tensor(np.array(Image.open(record["sem_seg_file_name"])), dtype=torch.int64)
    scores = torch.zeros((7, h, w)).scatter_(0, semantic.clamp(max=6)[None], 1.0)
    ids = torch.as_tensor(pq.rgb_to_id(np.asarray(Image.open(record["pan_seg_file_name"]))))
    anns = record["annotations"]
    inst = Instances((h, w))
    inst.scores = torch.ones(len(anns))
    inst.pred_classes = torch.as_tensor([a["category_id"] for a in anns], dtype=torch.int64)
    inst.pred_masks = torch.as_tensor(np.array([mask_util.decode(mask_util.merge(mask_util.frPyObjects(
        a["segmentation"], h, w))) for a in anns], dtype=bool).reshape(-1, h, w))
    return {"sem_seg": scores, "panoptic_seg": (ids, record["segments_info"]), "instances": inst}


def test_the_labels_score_100_against_themselves(labelled):
    evaluator = SegmentationEvaluator(NAME)
    assert evaluator.tasks == ("sem_seg", "panoptic_seg", "segm")
    evaluator.reset()
    for record in DatasetCatalog.get(NAME):
        evaluator.process([record], [truth_outputs(record)])
    got = evaluator.evaluate()
    assert got["sem_seg"]["mIoU"] == got["sem_seg"]["pACC"] == 100.0
    assert not any(k.startswith(("ACC-", "BoundaryIoU-")) for k in got["sem_seg"])
    assert got["panoptic_seg"]["PQ"] == got["panoptic_seg"]["PQ_st"] == 100.0
    assert got["segm"]["AP"] == pytest.approx(100.0)


def test_outputs_and_predictions_are_mirror_images():
    mask = np.zeros((6, 8), bool)
    mask[1:3, 2:5] = True
    semantic = np.arange(48, dtype=np.int32).reshape(6, 8) % 3
    panoptic = (semantic == 1).astype(np.int32)
    post = {"num_classes": 3, "class_names": ["a", "b", "c"]}
    p = Prediction(6, 8, [Instance(0.5, 1, class_name="b", mask=encode_mask(mask))], semantic, panoptic,
                   [Segment(1, 1, False, "b")])
    out = to_outputs(p, post)
    assert out["sem_seg"].shape == (3, 6, 8) and set(out) == {"instances", "sem_seg", "panoptic_seg"}
    back = prediction_of(out, post)
    assert back.instances == p.instances and back.segments == p.segments
    assert (back.semantic == semantic).all() and (back.panoptic == panoptic).all()
    assert "instances" not in to_outputs(p, {**post, "instance_on": False})
    moved = Prediction(6, 8, p.instances, np.where(semantic == 2, 0, semantic), panoptic, p.segments)
    assert difference(p, moved)[1].startswith("semantic maps differ in 33.33%")
    assert difference(p, Prediction(6, 8, p.instances, semantic, panoptic, []))[1].startswith("panoptic segments")


def test_per_picture_statistics_give_the_evaluators_own_miou_and_pq(labelled):
    """The intervals' statistics (d2export/evaluating/intervals.py) summed over pictures give detectron2's
    SemSegEvaluator's mIoU and the panoptic evaluator's PQ for the same predictions: the labels with, on every other
    picture, the left half of the background called a bar and its largest segment dropped from the panoptic map."""
    from d2export.evaluating import intervals
    from d2export.evaluating.runs import Run

    records = DatasetCatalog.get(NAME)
    evaluator, truths, changed = SegmentationEvaluator(NAME), [], []
    for k, record in enumerate(records):
        out = truth_outputs(record)
        truths.append(prediction_of(out, {"instance_on": False}))
        if k % 2 == 0:
            scores, (ids, segments) = out["sem_seg"].clone(), out["panoptic_seg"]
            left = scores[6].bool().clone()
            left[:, scores.shape[2] // 2:] = False
            scores[6][left], scores[5][left] = 0.0, 1.0
            largest = max(segments, key=lambda s: int((ids == s["id"]).sum()))
            out = dict(out, sem_seg=scores, panoptic_seg=(torch.where(ids == largest["id"], 0, ids),
                                                          [s for s in segments if s is not largest]))
        evaluator.process([record], [out])
        changed.append(prediction_of(out, {"instance_on": False}))
    own = evaluator.evaluate()
    assert own["sem_seg"]["mIoU"] < 90 and own["panoptic_seg"]["PQ"] < 99  # the change counts

    found = intervals.measures("segmentation", NAME, evaluator.tasks, {"sem_seg/mIoU": 0, "panoptic_seg/PQ": 0})
    assert len(found) == 2
    stats = intervals.statistics(found, Run("x", "float32", {}, changed), records)
    summed = {k: float(v[0]) for m, x in zip(found, stats) for k, v in m.figures(x.sum(0)[None]).items()}
    assert summed == pytest.approx({"sem_seg/mIoU": own["sem_seg"]["mIoU"],
                                    "panoptic_seg/PQ": own["panoptic_seg"]["PQ"]})
    reference = intervals.statistics(found, Run("x", "float32", {}, truths), records)
    diff = intervals.compared(found, reference, stats)
    for name, value in (("sem_seg/mIoU", own["sem_seg"]["mIoU"]), ("panoptic_seg/PQ", own["panoptic_seg"]["PQ"])):
        assert diff[name]["delta"] == pytest.approx(value - 100.0)
        assert diff[name]["low"] <= diff[name]["delta"] <= diff[name]["high"] <= 0.0
    assert intervals.compared(found, reference, reference)["sem_seg/mIoU"] == {"delta": 0.0, "low": 0.0, "high": 0.0}


# --- a Mask2Former under PyTorch and as its graph ------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(labelled, tmp_path_factory):
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("mask2former_seg")
    built = pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={out}", *OPTS, *FAST]))
    pipeline.export(built.cfg, built=built)
    return out


def test_mask2former_pytorch_and_onnx_score_the_same(labelled, exported):
    from d2export.evaluating.evaluate import evaluate

    report = evaluate([str(exported)], dataset=NAME, config="mask2former_tiny", overrides=OPTS,
                      evaluator="segmentation")
    torch_run, onnx_run = report["runs"]
    assert report["evaluator"] == "segmentation" and report["tasks"] == ["sem_seg", "panoptic_seg", "segm"]
    metrics = torch_run["metrics"]
    assert {"sem_seg/mIoU", "sem_seg/IoU-background", "panoptic_seg/PQ", "panoptic_seg/PQ_st",
            "segm/AP"} <= set(metrics)
    # seeded weights: the figures mean nothing, but the background is found (semantic; its panoptic segment covers
    # too little of it to match), so they are not all zero, and segments were counted
    assert metrics["sem_seg/IoU-background"] > 30 and not math.isnan(metrics["panoptic_seg/PQ_st"])
    assert onnx_run["metrics"].keys() == metrics.keys()
    for k, v in metrics.items():
        assert onnx_run["metrics"][k] == v or (math.isnan(v) and math.isnan(onnx_run["metrics"][k])), k
    assert report["comparisons"][0]["differing_pictures"] == 0
    assert report["comparisons"][0]["intervals"] == {k: {"delta": 0.0, "low": 0.0, "high": 0.0}
                                                     for k in ("sem_seg/mIoU", "panoptic_seg/PQ")}

    # the PyTorch column as detectron2's own test loader and inference_on_dataset count it, with its SemSegEvaluator
    own = detectron2_own()
    assert {f"sem_seg/{k}": v for k, v in own["sem_seg"].items() if f"sem_seg/{k}" in metrics} == \
        {k: v for k, v in metrics.items() if k.startswith("sem_seg/")}
    assert {f"panoptic_seg/{k}": v for k, v in own["panoptic_seg"].items()} == \
        {k: v for k, v in metrics.items() if k.startswith("panoptic_seg/")}


def detectron2_own():
    from detectron2.data import DatasetMapper, build_detection_test_loader
    from detectron2.evaluation import DatasetEvaluators, SemSegEvaluator, inference_on_dataset

    from d2export import pipeline
    from d2export.config import load
    from d2export.evaluating.evaluators import PanopticQualityEvaluator

    built = pipeline.prepare(load("mask2former_tiny", ["export.output_dir=unused", *OPTS]))
    loader = build_detection_test_loader(dataset=DatasetCatalog.get(NAME),
                                         mapper=DatasetMapper(built.d2cfg, is_train=False))
    read = lambda path, dtype: np.array(Image.open(path), dtype=dtype)  # noqa: E731 - its own reader fails on numpy 2
    semantic = SemSegEvaluator(NAME, distributed=False, sem_seg_loading_fn=read)
    return inference_on_dataset(built.model, loader, DatasetEvaluators([semantic, PanopticQualityEvaluator(NAME)]))
