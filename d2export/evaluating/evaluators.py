"""The metrics `d2export evaluate` reports, all through detectron2's `DatasetEvaluator` interface: COCO's for boxes,
masks and keypoints, d2export's text evaluator for text spotters (a family's `evaluator` says which), or the user's
own class (`--evaluator module:Class`, constructed as detectron2 training code constructs evaluators)."""
from __future__ import annotations

import importlib
import inspect
from collections import OrderedDict
from typing import Any

import numpy as np
from detectron2.evaluation import DatasetEvaluator

from d2export.charset import charset, decode
from d2export.evaluating.convert import to_prediction
from d2export.evaluating.text_metrics import Counts, Word, count


def ground_truth_words(record: dict, voc_size: int) -> list[Word]:
    """A text set's words in one dataset record: the boundary polygon (AdelaiDet's `polygons`/`polys`, else the
    segmentation) and the transcription decoded from `rec` ('###' stays don't care)."""
    chars = charset(voc_size)
    words = []
    for a in record.get("annotations", []):
        points = a.get("polygons", a.get("polys"))
        if points is None and a.get("segmentation"):
            points = a["segmentation"][0]
        if points is None:
            continue
        rec = a.get("rec", a.get("text"))
        text = decode(rec, chars) if isinstance(rec, (list, tuple)) else str(rec or "")
        words.append(Word(np.asarray(points, np.float64).reshape(-1, 2), text))
    return words


def detected_words(instances, post: dict[str, Any]) -> list[tuple[float, Word]]:
    """A model's Instances as the text evaluator reads them: (score, Word) for each detection with an outline."""
    return [(i.score, Word(np.asarray(i.boundary or i.polygon, np.float64).reshape(-1, 2), i.text or ""))
            for i in to_prediction(instances.to("cpu"), post).instances if (i.boundary or i.polygon)]


class TextSpottingEvaluator(DatasetEvaluator):
    """Detection precision/recall/H-mean at polygon IoU 0.5 and end-to-end word accuracy without lexicon
    (see text_metrics). Detections are read as `to_prediction` reads a model's Instances: the outline (`bd`,
    `polygons`, Bézier outline) and the text (`texts`, or `recs` read with the model's character set).
    With `thresholds`, the same figures also for the detections scoring at least each of them (`text_by_threshold`):
    a score-threshold sweep from one run of a model whose own threshold is at or below the lowest."""

    def __init__(self, dataset_name: str, post: dict[str, Any], thresholds=()):
        from detectron2.data import DatasetCatalog, MetadataCatalog

        voc_size = int(getattr(MetadataCatalog.get(dataset_name), "voc_size", 96))
        self._truth = {r["image_id"]: ground_truth_words(r, voc_size) for r in DatasetCatalog.get(dataset_name)}
        self._post = post
        self._thresholds = tuple(thresholds)
        self.reset()

    def reset(self) -> None:
        self._counts = {t: Counts() for t in (None, *self._thresholds)}  # None: every detection

    def process(self, inputs, outputs) -> None:
        for given, out in zip(inputs, outputs):
            found = detected_words(out["instances"], self._post)
            truth = self._truth[given["image_id"]]
            for t in self._counts:
                kept = [word for score, word in found if t is None or score >= t]
                self._counts[t] = self._counts[t] + count(truth, kept)

    def evaluate(self):
        figures = OrderedDict(text=self._counts[None].summary())
        if self._thresholds:
            figures["text_by_threshold"] = {t: self._counts[t].summary() for t in self._thresholds}
        return figures


class Over(DatasetEvaluator):
    """An evaluator over some of a dataset's pictures: COCO's counts every picture of its JSON unless told which."""

    def __init__(self, inner: DatasetEvaluator, image_ids: list):
        self.inner, self.image_ids = inner, image_ids

    def reset(self) -> None:
        self.inner.reset()

    def process(self, inputs, outputs) -> None:
        self.inner.process(inputs, outputs)

    def evaluate(self):
        return self.inner.evaluate(img_ids=self.image_ids)


def build_evaluator(kind: str, dataset_name: str, post: dict[str, Any], tasks: tuple[str, ...], cfg: Any,
                    output_dir: str, image_ids: list | None = None) -> DatasetEvaluator:
    """`kind`: "text", "coco" (over `tasks`, and only `image_ids` where given) or "module:Class" (the user's: given
    the dataset name and whichever of cfg, distributed=False, output_dir and tasks its constructor takes)."""
    if kind == "text":
        return TextSpottingEvaluator(dataset_name, post)
    if kind == "coco":
        from detectron2.evaluation import COCOEvaluator

        coco = COCOEvaluator(dataset_name, tasks=tasks, distributed=False, output_dir=None)
        return Over(coco, image_ids) if image_ids is not None else coco
    module, _, name = kind.partition(":")
    if not name:
        raise ValueError(f"--evaluator {kind!r}: write it as module:Class (or text, coco)")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--evaluator {kind!r} cannot be loaded: {e}") from None
    offered = {"cfg": cfg, "distributed": False, "output_dir": output_dir, "tasks": tasks}
    params = inspect.signature(cls).parameters
    return cls(dataset_name, **{k: v for k, v in offered.items() if k in params})
