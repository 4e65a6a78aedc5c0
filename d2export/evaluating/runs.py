"""One evaluation run: a model over a dataset's pictures, through an evaluator. The PyTorch run is detectron2's own
`inference_on_dataset` over the model as export builds it, fed as detectron2's test-time `DatasetMapper` feeds it;
an exported model's run goes through the serving runtime's `Predictor`, its predictions handed to the same kind of
evaluator as the output dict the model's own inference gives (`Instances`, and a segmenter's maps). Every run also
keeps its predictions (`Prediction`s, detections in score order) for the comparison."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from detectron2.evaluation import DatasetEvaluator, DatasetEvaluators

from d2export.evaluating.convert import prediction_of, to_outputs
from d2export.instances import Instance, Prediction
from d2export.progress import steps
from d2export.served_kinds import kinds
from d2export.served_kinds.declaration import CATEGORICAL


@dataclass
class Run:
    name: str  # "PyTorch", or the model's folder
    precision: str  # float32, float16, …
    metrics: dict[str, float]
    predictions: list[Prediction] = field(repr=False)
    model: str = ""
    latency_ms: float = math.nan  # median per picture of the model's call: eager forward, or the predictor's predict
    threads: int = 0  # the CPU threads it ran on (torch's, or onnxruntime's intra-op)
    runtime: str = ""  # what served it: the manifest's (onnxruntime, openvino); "" for PyTorch

    @property
    def label(self) -> str:
        """How tables and plots name it: its name, precision and, where not onnxruntime, the runtime serving it."""
        said = ", ".join(x for x in (self.precision, self.runtime) if x and x != "onnxruntime")
        return f"{self.name} ({said})" if said else self.name


def median_ms(seconds: Sequence[float]) -> float:
    return float(np.median(seconds) * 1e3) if len(seconds) else math.nan


def flatten(results: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """An evaluator's nested results → {"bbox/AP": 41.2, …} (numbers only)."""
    flat = {}
    for key, value in (results or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def by_score(prediction: Prediction) -> Prediction:
    """Its detections in score order (stable), on both sides of a comparison, which pairs them one by one: most
    models return them so, but Mask2Former's top-k leaves them unsorted and the runtime sorts them."""
    prediction.instances.sort(key=lambda i: -i.score)
    return prediction


class _Keep(DatasetEvaluator):
    """Keeps what the model returned, as Predictions in dataset order."""

    def __init__(self, post: dict[str, Any]):
        self.post, self.predictions = post, []

    def reset(self) -> None:
        self.predictions = []

    def process(self, inputs, outputs) -> None:
        self.predictions += [by_score(prediction_of(o, self.post)) for o in outputs]

    def evaluate(self):
        return None


class EagerInputs:
    """A dataset's records as detectron2's test-time DatasetMapper makes them (detectron2's read_image and
    ResizeShortestEdge), one picture per batch: what `inference_on_dataset` iterates."""

    def __init__(self, records: Sequence[dict], pre: dict[str, Any]):
        self.records, self.pre = records, pre

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        import torch
        from detectron2.data import detection_utils
        from detectron2.data import transforms as T

        resize = T.ResizeShortestEdge(self.pre["min_size_test"], self.pre["max_size_test"])
        for record in steps(self.records, "PyTorch"):
            image = detection_utils.read_image(record["file_name"], format=self.pre.get("input_format", "BGR"))
            image = resize.get_transform(image).apply_image(image)
            yield [dict(record, image=torch.as_tensor(np.ascontiguousarray(image.transpose(2, 0, 1))))]


def pytorch_run(model, records: Sequence[dict], evaluator: DatasetEvaluator, pre: dict[str, Any],
                post: dict[str, Any]) -> Run:
    import torch
    from detectron2.evaluation import inference_on_dataset

    from d2export.building import exact_float32

    keep, timed = _Keep(post), _Timed(model)
    # on CUDA as export computes its references: TF32 (cuDNN's default) moves a two-stage model's near-tied proposals,
    # and the column every graph is compared with must be float32 (measured on an H200: with it on, 52 of 300 box
    # fixture pictures differed between PyTorch and the float32 graph)
    with exact_float32():
        results = inference_on_dataset(timed, EagerInputs(records, pre), DatasetEvaluators([evaluator, keep]))
    return Run("PyTorch", "float32", flatten(results), keep.predictions, latency_ms=median_ms(timed.seconds),
               threads=torch.get_num_threads())


def _Timed(model):
    """`model` (an nn.Module, as inference_on_dataset wants) behind a wrapper that times each call."""
    import time

    import torch
    from torch import nn

    class Timed(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.seconds = model, []

        def forward(self, inputs):
            started = time.perf_counter()
            out = self.model(inputs)
            if torch.cuda.is_initialized():  # the call's work done, not only launched
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - started)
            return out

    return Timed()


def onnx_run(model_path: Path, records: Sequence[dict], make_evaluator: Callable[[dict], DatasetEvaluator],
             providers: Sequence[str] = ("cpu",), threads: int = 0, verify_hash: bool = True) -> Run:
    from d2export.runtime.image_decoding import read_image
    from d2export.runtime.predictor import Predictor

    predictor = Predictor(model_path, providers=providers, threads=threads, verify_hash=verify_hash)
    post = predictor.manifest.postprocess
    evaluator = make_evaluator(post)
    evaluator.reset()
    predictions, seconds = [], []
    for record in steps(records, model_path.parent.name or model_path.name):
        image = read_image(record["file_name"])
        started = time.perf_counter()
        prediction = predictor.predict(image)
        seconds.append(time.perf_counter() - started)
        predictions.append(by_score(prediction))
        evaluator.process([record], [to_outputs(prediction, post)])
    return Run(model_path.parent.name, predictor.manifest.precision, flatten(evaluator.evaluate()), predictions,
               str(model_path), median_ms(seconds), threads, predictor.manifest.runtime)


def _points(instances: Sequence[Instance]) -> list[np.ndarray]:
    out = []
    for i in instances:
        parts = [np.ravel(v) for v in (i.box, i.polygon, i.boundary, i.keypoints, i.beziers) if v is not None]
        out.append(np.concatenate(parts) if parts else np.zeros(0))
    return out


def _compared(kinds_: tuple, x: Any, y: Any) -> list[tuple[float, str]]:
    """What the served kinds' own comparisons (d2export/served_kinds/) find between x and y, in the kinds' order."""
    return [d for k in kinds_ if k.compare and (d := k.compare(getattr(x, k.name), getattr(y, k.name)))]


def difference(a: Prediction, b: Prediction, pixels: float = 0.5) -> tuple[float, str] | None:
    """How two predictions of one picture differ, as (severity, what), or None where they agree: the number of
    detections, a class or a transcription, each served kind as it declares (the panoptic segments' ids and classes;
    semantic or panoptic maps in over MAP_SHARE of their pixels), points more than `pixels` apart, masks differing in
    over 1% of the pixels either covers. Detections are compared in the pairs `paired` makes, not in score order.
    Severity orders the worst first: a count difference above all, then labels, text and segments, then masks, maps
    and distance."""
    if len(a.instances) != len(b.instances):
        return 1e6 + abs(len(a.instances) - len(b.instances)), f"{len(a.instances)} vs {len(b.instances)} detections"
    theirs = paired(a.instances, b.instances)
    for x, y in zip(a.instances, theirs):
        if x.label != y.label:
            return CATEGORICAL, f"class {x.label} vs {y.label}"
        if (x.text or "") != (y.text or ""):
            return CATEGORICAL, f"text {x.text!r} vs {y.text!r}"
        found = _compared(kinds("instance"), x, y)
        if found:
            return found[0]
    found = _compared(kinds("picture"), a, b)
    if found:  # a categorical difference (the segments) before a graded one (a map's share of pixels)
        return min(found, key=lambda d: d[0] < CATEGORICAL)
    gap = max((float(np.abs(p - q).max()) for p, q in zip(_points(a.instances), _points(theirs))
               if p.size and p.shape == q.shape), default=0.0)
    masks = [(x.mask, y.mask) for x, y in zip(a.instances, theirs) if x.mask and y.mask]
    if masks:
        from d2export.instances import decode_mask, mask_iou

        # a share of the pixels either covers (1 - IoU): bounded, and an empty mask against another is 100%, where a
        # share of the first's area read 33300% for a few pixels against one
        worst = max(1 - mask_iou(decode_mask(m), decode_mask(n)) for m, n in masks)
        if worst > 0.01:
            return 1e4 * worst, f"masks differ in {worst:.1%} of the pixels either covers"
    if gap > pixels or math.isnan(gap):
        return gap, f"points {gap:.2f} px apart"
    return None


def paired(a: Sequence[Instance], b: Sequence[Instance]) -> list[Instance]:
    """`b`'s detections in the order that faces each of `a`'s with its own: served detections are a set shown in
    score order, and two runs may order near-tied scores either way (measured: a trained Mask2Former's PyTorch and
    float32 graph ordered 103 of 200 pictures differently, with the same metrics). Each of `a`'s, in score order, takes
    the one of `b`'s left that is most plainly the same detection: the same class, then the same text, then the
    largest overlap (mask IoU, else box IoU, else the nearest points). A detection that changed still meets its
    nearest counterpart and is told apart by `difference`; agreeing runs pair in their own order."""
    n = len(a)
    if n != len(b) or n < 2:
        return list(b)
    same_label = np.array([[x.label == y.label for y in b] for x in a])
    same_text = np.array([[(x.text or "") == (y.text or "") for y in b] for x in a])
    overlap = _overlap(a, b)
    left, order = np.ones(n, bool), []
    for i in range(n):
        key = np.where(left, same_label[i] * 4.0 + same_text[i] * 2.0 + overlap[i], -np.inf)
        j = int(np.argmax(key))  # ties: the first, so agreeing runs keep their order
        left[j] = False
        order.append(b[j])
    return order


def _overlap(a: Sequence[Instance], b: Sequence[Instance]) -> np.ndarray:
    """[len(a), len(b)] in [0, 1]: mask IoU where both have masks, else box IoU, else 1 / (1 + the points' largest
    distance in pixels)."""
    if all(i.mask for i in (*a, *b)):
        from pycocotools import mask as coco_mask

        from d2export.instances import coco_rle

        return np.asarray(coco_mask.iou([coco_rle(i.mask) for i in a], [coco_rle(i.mask) for i in b],
                                        [0] * len(b)), float).reshape(len(a), len(b))
    if all(i.box is not None for i in (*a, *b)):
        import torch
        from detectron2.structures import Boxes, pairwise_iou

        boxes = lambda xs: Boxes(torch.tensor([i.box for i in xs], dtype=torch.float64))  # noqa: E731
        return pairwise_iou(boxes(a), boxes(b)).numpy()
    p, q = _points(a), _points(b)
    return np.array([[1 / (1 + float(np.abs(x - y).max())) if x.size and x.shape == y.shape else 0.0 for y in q]
                     for x in p])

