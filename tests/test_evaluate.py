"""`d2export evaluate`: PyTorch and exported models through one evaluator on a synthetic set, the PyTorch column
checked against detectron2's own `inference_on_dataset`, and bad input refused before anything is written."""
import json

import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.evaluation import DatasetEvaluator

from d2export.cli import main
from d2export.datasets import generate, register
from d2export.evaluating.convert import to_instances, to_prediction
from d2export.evaluating.evaluate import EvaluateError, compare, evaluate, write_vis
from d2export.evaluating.evaluators import TextSpottingEvaluator
from d2export.evaluating.runs import Run, difference
from d2export.instances import Instance, Prediction, encode_mask
from exports import export

SIZE = (224, 176)


class Fingerprint(DatasetEvaluator):
    """A user's evaluator (constructed as detectron2 training code does): sums of what the model returned, so that
    two runs agree only if their detections do."""

    def __init__(self, dataset_name, cfg=None, distributed=True, output_dir=None):
        self.dataset_name = dataset_name
        self.reset()

    def reset(self):
        self.n, self.scores, self.coords = 0, 0.0, 0.0

    def process(self, inputs, outputs):
        for out in outputs:
            inst = out["instances"].to("cpu")
            self.n += len(inst)
            self.scores += float(inst.scores.double().sum())
            for field in ("pred_boxes", "polygons", "beziers"):
                if inst.has(field):
                    value = inst.get(field)
                    self.coords += float((value.tensor if field == "pred_boxes" else value).double().sum())

    def evaluate(self):
        return {"fingerprint": {"detections": self.n, "score_sum": self.scores, "coord_sum": self.coords}}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_sets")
    return (generate("text", root / "text", count=4, seed=5, size=SIZE, workers=1),
            generate("boxes", root / "boxes", count=4, seed=5, size=SIZE, workers=1))


@pytest.fixture(scope="module")
def rcnn_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("rcnn_export")
    export("rcnn", out, "export.lint=false")  # what is evaluated is the graph, not its lint
    return out


def detectron2_own(config, dataset, evaluator_factory):
    """The independent reference: detectron2's test loader and inference_on_dataset on the model export builds."""
    from detectron2.data import DatasetMapper, build_detection_test_loader
    from detectron2.evaluation import inference_on_dataset

    from d2export import pipeline
    from d2export.config import load

    built = pipeline.prepare(load(config, ["export.output_dir=unused"]))
    loader = build_detection_test_loader(dataset=DatasetCatalog.get(dataset),
                                         mapper=DatasetMapper(built.d2cfg, is_train=False))
    return inference_on_dataset(built.model, loader, evaluator_factory(built))


def agree(a: dict, b: dict, rel=1e-5, abs_=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        if np.isnan(a[k]):
            assert np.isnan(b[k]), k
        else:
            assert b[k] == pytest.approx(a[k], rel=rel, abs=abs_), k


def test_testr_pytorch_and_onnx_side_by_side(tiny_export, sets, tmp_path):
    _, _, model = tiny_export
    report_path = tmp_path / "report.json"
    report = evaluate([str(model.parent)], dataset=str(sets[0]), config="textdet_tiny", json_path=str(report_path))
    assert json.loads(report_path.read_text()) == json.loads(json.dumps(report))
    torch_run, onnx_run = report["runs"]
    assert torch_run["name"] == "PyTorch" and onnx_run["precision"] == "float32" and report["evaluator"] == "text"
    assert {"text/det_hmean", "text/e2e_hmean", "text/det_precision"} <= torch_run["metrics"].keys()
    assert torch_run["metrics"]["text/words"] == sum(len(r["annotations"]) for r in DatasetCatalog.get(report["dataset"]))
    assert torch_run["metrics"]["text/detections"] > 0  # seeded weights: detections, at random places
    agree(torch_run["metrics"], onnx_run["metrics"], rel=0, abs_=0)
    assert report["comparisons"][0]["differing_pictures"] == 0
    assert report["comparisons"][0]["intervals"] == {f"text/{k}": {"delta": 0.0, "low": 0.0, "high": 0.0}
                                                     for k in ("det_hmean", "e2e_hmean")}

    # a user's evaluator, and the PyTorch column equal to detectron2's own inference_on_dataset with it
    theirs = evaluate([str(model.parent)], dataset=str(sets[0]), config="textdet_tiny",
                      evaluator="test_evaluate:Fingerprint")
    own = detectron2_own("textdet_tiny", theirs["dataset"], lambda built: Fingerprint(theirs["dataset"]))
    assert own["fingerprint"]["detections"] > 0
    assert theirs["runs"][0]["metrics"] == {f"fingerprint/{k}": float(v) for k, v in own["fingerprint"].items()}
    agree(theirs["runs"][0]["metrics"], theirs["runs"][1]["metrics"])
    own_text = detectron2_own("textdet_tiny", report["dataset"],
                              lambda built: TextSpottingEvaluator(report["dataset"],
                                                                  built.family.postprocess(built.d2cfg)))
    assert {f"text/{k}": float(v) for k, v in own_text["text"].items()} == torch_run["metrics"]


def test_rcnn_coco_metrics_side_by_side_and_as_detectron2_counts_them(rcnn_export, sets):
    from detectron2.evaluation import COCOEvaluator

    report = evaluate([str(rcnn_export)], dataset=str(sets[1]), config="rcnn")
    torch_run, onnx_run = report["runs"]
    assert report["evaluator"] == "coco" and report["tasks"] == ["bbox"]
    assert {"bbox/AP", "bbox/AP50", "bbox/AP-star"} <= torch_run["metrics"].keys()
    agree(torch_run["metrics"], onnx_run["metrics"])
    assert report["comparisons"][0]["differing_pictures"] == 0
    assert "intervals" not in report["comparisons"][0]  # AP is not a sum over pictures: no bootstrap of it here
    own = detectron2_own("rcnn", report["dataset"],
                         lambda built: COCOEvaluator(report["dataset"], tasks=("bbox",), distributed=False))
    agree({f"bbox/{k}": v for k, v in own["bbox"].items()}, torch_run["metrics"], rel=0, abs_=0)
    fingerprint = evaluate([str(rcnn_export)], dataset=str(sets[1]), config="rcnn", max_images=2,
                           evaluator="test_evaluate:Fingerprint")
    assert fingerprint["pictures"] == 2 and fingerprint["runs"][0]["metrics"]["fingerprint/detections"] > 0
    agree(fingerprint["runs"][0]["metrics"], fingerprint["runs"][1]["metrics"])


def test_text_evaluator_scores_the_labels_themselves_100_and_counts_a_misread(sets):
    name = register("eval_text_truth", sets[0])
    try:
        from d2export.charset import charset

        post = {"charset": "".join(charset(96)), "text_decoding": "slots"}
        evaluator = TextSpottingEvaluator(name, post)
        records = DatasetCatalog.get(name)
        for misread in (False, True):
            evaluator.reset()
            for r in records:
                from detectron2.structures import Instances

                inst = Instances((r["height"], r["width"]))
                inst.scores = torch.ones(len(r["annotations"]))
                inst.polygons = torch.tensor([a["polys"] for a in r["annotations"]])
                recs = [list(a["rec"]) for a in r["annotations"]]
                if misread and r is records[0]:
                    recs[0][0] = 94 if recs[0][0] != 94 else 93  # its first character read as '~' (or '}')
                inst.recs = torch.tensor(recs)
                evaluator.process([r], [{"instances": inst}])
            s = evaluator.evaluate()["text"]
            words = sum(len(r["annotations"]) for r in records)
            assert s["det_hmean"] == 100.0 and s["words"] == s["detections"] == words
            assert s["e2e_hmean"] == pytest.approx(100.0 * (words - misread) / words)
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


def test_bad_input_is_named_and_nothing_is_written(tiny_export, rcnn_export, sets, tmp_path, capsys):
    _, _, model = tiny_export
    out = tmp_path / "report.json"
    register("eval_named_set", sets[0])
    try:
        with pytest.raises(EvaluateError, match=r"'eval_named_sat' is neither.*did you mean 'eval_named_set'.*"
                                                r"registered: .*eval_named_set"):
            evaluate([str(model.parent)], dataset="eval_named_sat", json_path=str(out))
    finally:
        DatasetCatalog.remove("eval_named_set")
        MetadataCatalog.remove("eval_named_set")
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [}')
    with pytest.raises(EvaluateError, match=r"broken.json: not JSON \(line 1, column 13"):
        evaluate([str(model.parent)], coco_json=str(broken), image_root=str(tmp_path), json_path=str(out))
    empty = tmp_path / "no_pictures"
    empty.mkdir()
    with pytest.raises(EvaluateError, match=r"names 4 picture\(s\) that do not exist, e\.g\. .*000000\.jpg"):
        evaluate([str(model.parent)], coco_json=str(sets[0] / "annotations.json"), image_root=str(empty),
                 json_path=str(out))
    with pytest.raises(EvaluateError, match="is a rcnn model, but --config builds a testr model"):
        evaluate([str(rcnn_export)], dataset=str(sets[0]), config="textdet_tiny", json_path=str(out))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["broken.json", "no_pictures"]
    assert main(["evaluate", str(model.parent), "--dataset", "no_such_set"]) == 2
    assert "no_such_set" in capsys.readouterr().err
    assert main(["evaluate", "export.opset=17", "--dataset", "x"]) == 2
    assert "need --config" in capsys.readouterr().err


def text_prediction(shift=0.0, text="Hello", n=1):
    polygon = (np.array([[10, 10], [60, 10], [60, 30], [10, 30]], float) + shift).tolist()
    return Prediction(100, 120, [Instance(score=0.75, label=0, polygon=polygon, text=text)] * n)


def test_differences_are_found_and_ranked():
    assert difference(text_prediction(), text_prediction(0.3)) is None  # float noise
    assert difference(text_prediction(), text_prediction(2.0))[1] == "points 2.00 px apart"
    assert difference(text_prediction(), text_prediction(text="Hellp"))[1] == "text 'Hello' vs 'Hellp'"
    assert difference(text_prediction(), text_prediction(n=2))[1] == "1 vs 2 detections"
    mask = np.zeros((100, 120), bool)
    mask[10:30, 10:60] = True
    other = mask.copy()
    other[10:30, 60:62] = True
    a = Prediction(100, 120, [Instance(0.9, 1, box=[10, 10, 60, 30], mask=encode_mask(mask))])
    b = Prediction(100, 120, [Instance(0.9, 1, box=[10, 10, 60, 30], mask=encode_mask(other))])
    assert difference(a, b)[1] == "masks differ in 3.8% of the pixels either covers"  # 40 of 1040
    # a mask with no pixels against one with a few: all of them differ, no more (a share of the first's area was
    # 33300% on a segmenter's empty mask)
    empty, few = np.zeros_like(mask), np.zeros_like(mask)
    few[0, :3] = True
    c, d = (Prediction(100, 120, [Instance(0.9, 1, box=[0, 0, 3, 1], mask=encode_mask(m))]) for m in (empty, few))
    assert difference(c, d)[1] == difference(d, c)[1] == "masks differ in 100.0% of the pixels either covers"
    reference = Run("PyTorch", "float32", {}, [text_prediction(), text_prediction(), text_prediction()])
    run = Run("model", "float16", {}, [text_prediction(2.0), text_prediction(), text_prediction(n=3)])
    records = [{"file_name": f"p{i}.jpg"} for i in range(3)]
    c = compare(reference, run, records)
    assert c["differing_pictures"] == 2
    assert [w["picture"] for w in c["worst"]] == ["p2.jpg", "p0.jpg"]  # a count difference first


def _square(top: int, left: int, side: int = 20) -> dict:
    mask = np.zeros((100, 120), bool)
    mask[top:top + side, left:left + side] = True
    return encode_mask(mask)


def test_near_tied_detections_in_another_order_are_the_same_but_a_change_is_still_found():
    """Two runs may order near-tied scores either way: detections are paired by what they are, not by rank."""
    first, second = Instance(0.5001, 1, mask=_square(10, 10)), Instance(0.5000, 2, mask=_square(50, 70))
    a = Prediction(100, 120, [first, second])
    swapped = Prediction(100, 120, [Instance(0.5001, 2, mask=_square(50, 70)), Instance(0.5000, 1, mask=_square(10, 10))])
    assert difference(a, swapped) is None
    # the same two masks with their classes exchanged: a wrong graph, whichever order it serves them in (each class
    # meets its own, whose mask is elsewhere)
    relabelled = Prediction(100, 120, [Instance(0.5001, 2, mask=_square(10, 10)), Instance(0.5, 1, mask=_square(50, 70))])
    assert difference(a, relabelled)[1] == "masks differ in 100.0% of the pixels either covers"
    assert difference(a, Prediction(100, 120, [Instance(0.5001, 1, mask=_square(10, 10)),
                                               Instance(0.5, 3, mask=_square(50, 70))]))[1] == "class 2 vs 3"
    # one mask moved by 4 px, in the other order: still found, against its own counterpart
    moved = Prediction(100, 120, [Instance(0.5001, 2, mask=_square(50, 70)), Instance(0.5, 1, mask=_square(14, 10))])
    assert difference(a, moved)[1] == "masks differ in 33.3% of the pixels either covers"  # 160 of 480
    # the same class twice: told apart by where they are (boxes, then points, where there are no masks)
    boxes = [Instance(0.5001, 1, box=[10, 10, 30, 30]), Instance(0.5, 1, box=[70, 50, 90, 70])]
    assert difference(Prediction(100, 120, boxes), Prediction(100, 120, boxes[::-1])) is None
    words = [text_prediction().instances[0], text_prediction(40.0, text="World").instances[0]]
    assert difference(Prediction(100, 120, words), Prediction(100, 120, words[::-1])) is None
    misread = [words[1], Instance(0.75, 0, polygon=words[0].polygon, text="Hellp")]
    assert difference(Prediction(100, 120, words), Prediction(100, 120, misread))[1] == "text 'Hello' vs 'Hellp'"


def test_vis_shows_reference_and_model_side_by_side(tmp_path):
    from PIL import Image

    picture = tmp_path / "p0.png"
    Image.new("RGB", (120, 100), (90, 90, 90)).save(picture)
    reference = Run("PyTorch", "float32", {}, [text_prediction()])
    run = Run("model", "float16", {}, [text_prediction(3.0)])
    written = write_vis(tmp_path / "vis", reference, run, compare(reference, run, [{"file_name": str(picture)}]))
    assert [p.relative_to(tmp_path).as_posix() for p in written] == ["vis/model/p0.png"]
    assert Image.open(written[0]).size[0] > 2 * 120


def test_converters_are_mirror_images():
    from d2export.charset import charset

    post = {"charset": "".join(charset(96)), "num_chars": 25}
    text = text_prediction(text="Ab 9")
    inst = to_instances(text, post)
    assert inst.polygons.shape == (1, 8) and inst.recs[0, :5].tolist() == [33, 66, 0, 25, 96]
    assert to_prediction(inst, post) == text
    mask = np.zeros((100, 120), bool)
    mask[5:9, 7:30] = True
    boxes = Prediction(100, 120, [Instance(0.5, 3, box=[7.0, 5.0, 30.0, 9.0], mask=encode_mask(mask),
                                           keypoints=[[8.0, 6.0, 0.75]])])
    back = to_prediction(to_instances(boxes, {}), {})
    assert back == boxes
    inst.remove("texts")  # an evaluator reading ids only: slot ids read back the same text
    assert to_prediction(inst, post).instances[0].text == "Ab 9"


def test_each_precision_gets_a_column_with_its_latency(sets, tmp_path):
    """--precision exports --config at each precision and evaluates it; every column, PyTorch's too, states its
    median latency on the same number of threads, and --plot draws accuracy against it."""
    report = evaluate([], dataset=str(sets[0]), config="textdet_tiny", precisions=["fp32", "fp16"],
                      threads=1, plot_path=str(tmp_path / "plot.png"),
                      overrides=["verify.sizes=[[160,224]]", "verify.batch=false", "export.lint=false"])
    torch_run, fp32, fp16 = report["runs"]
    assert (fp32["name"], fp32["precision"], fp16["name"], fp16["precision"]) == ("fp32", "float32", "fp16", "float16")
    assert all(r["latency_ms"] > 0 and r["threads"] == 1 for r in report["runs"])
    agree(torch_run["metrics"], fp32["metrics"], rel=0, abs_=0)
    assert fp16["metrics"].keys() == fp32["metrics"].keys() and report["cpu"]
    for c, run in zip(report["comparisons"], (fp32, fp16)):  # each difference with its interval (test_intervals.py)
        assert c["intervals"].keys() == {"text/det_hmean", "text/e2e_hmean"}
        for k, v in c["intervals"].items():
            assert v["delta"] == pytest.approx(run["metrics"][k] - torch_run["metrics"][k], abs=1e-9)
    from PIL import Image

    assert Image.open(tmp_path / "plot.png").size[0] > 300
    with pytest.raises(EvaluateError, match="give --config"):
        evaluate([], dataset=str(sets[0]), precisions=["fp16"])
    with pytest.raises(EvaluateError, match="choose from"):
        evaluate([], dataset=str(sets[0]), config="textdet_tiny", precisions=["int4"])


def test_the_table_states_latency_and_threads():
    from d2export.evaluating.evaluate import table

    reference = Run("PyTorch", "float32", {"bbox/AP": 50.0}, [], latency_ms=100.0, threads=2)
    run = Run("int8", "int8", {"bbox/AP": 49.5}, [], latency_ms=40.0, threads=2)
    text = table([reference, run], reference)
    assert "-0.50" in text and "0.40x" in text
    assert text.splitlines()[-2].split()[-3:] == ["100.0", "40.0", "0.40x"]
    assert text.splitlines()[-1].split()[-2:] == ["2", "2"]
    assert "int8 (int8)" in text.splitlines()[0]  # served by onnxruntime: not said


def test_a_run_served_by_openvino_says_so_in_its_column():
    from d2export.evaluating.evaluate import table

    reference = Run("PyTorch", "float32", {"bbox/AP": 50.0}, [], latency_ms=100.0, threads=2)
    runs = [reference, Run("int8-openvino", "int8", {"bbox/AP": 49.5}, [], latency_ms=40.0, threads=2,
                           runtime="openvino"),
            Run("int8-static", "int8", {"bbox/AP": 49.0}, [], latency_ms=50.0, threads=2, runtime="onnxruntime")]
    heads = table(runs, reference).splitlines()[0]
    assert "int8-openvino (int8, openvino)" in heads and "int8-static (int8) " in heads
