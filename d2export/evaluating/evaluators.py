"""The metrics `d2export evaluate` reports, all through detectron2's `DatasetEvaluator` interface: COCO's for boxes,
masks and keypoints, d2export's text evaluator for text spotters, the segmentation evaluator for segmenters (mIoU,
PQ, mask AP; a family's `evaluator` says which), or the user's own class (`--evaluator module:Class`, constructed as
detectron2 training code constructs evaluators)."""
from __future__ import annotations

import importlib
import inspect
from collections import OrderedDict
from typing import Any

import numpy as np
from detectron2.evaluation import DatasetEvaluator

from d2export.charset import charset, decode
from d2export.evaluating import panoptic_quality as pq
from d2export.evaluating.convert import to_prediction
from d2export.evaluating.text_metrics import Counts, Word, count

KINDS = ("coco", "text", "segmentation")
# what a user receives, one figure each, by which accuracy is judged (verify.int8_accuracy): the text evaluator's
# detection and end-to-end H-mean, COCO's AP of boxes, masks and keypoints, the semantic map's mIoU, panoptic PQ
HEADLINE = ("text/det_hmean", "text/e2e_hmean", "bbox/AP", "segm/AP", "keypoints/AP", "sem_seg/mIoU",
            "panoptic_seg/PQ")


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


def prediction_words(prediction) -> list[tuple[float, Word]]:
    """A Prediction as the text evaluator reads it: (score, Word) for each detection with an outline."""
    return [(i.score, Word(np.asarray(i.boundary or i.polygon, np.float64).reshape(-1, 2), i.text or ""))
            for i in prediction.instances if (i.boundary or i.polygon)]


def detected_words(instances, post: dict[str, Any]) -> list[tuple[float, Word]]:
    """A model's Instances as the text evaluator reads them."""
    return prediction_words(to_prediction(instances.to("cpu"), post))


def voc_size(dataset_name: str) -> int:
    """The character-set size a text set's `rec` ids are written in (its metadata's, AdelaiDet's 96 by default)."""
    from detectron2.data import MetadataCatalog

    return int(getattr(MetadataCatalog.get(dataset_name), "voc_size", 96))


class TextSpottingEvaluator(DatasetEvaluator):
    """Detection precision/recall/H-mean at polygon IoU 0.5 and end-to-end word accuracy without lexicon
    (see text_metrics). Detections are read as `to_prediction` reads a model's Instances: the outline (`bd`,
    `polygons`, Bézier outline) and the text (`texts`, or `recs` read with the model's character set).
    With `thresholds`, the same figures also for the detections scoring at least each of them (`text_by_threshold`):
    a score-threshold sweep from one run of a model whose own threshold is at or below the lowest."""

    def __init__(self, dataset_name: str, post: dict[str, Any], thresholds=()):
        from detectron2.data import DatasetCatalog

        size = voc_size(dataset_name)
        self._truth = {r["image_id"]: ground_truth_words(r, size) for r in DatasetCatalog.get(dataset_name)}
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


class PanopticQualityEvaluator(DatasetEvaluator):
    """PQ, SQ and RQ (panoptic_quality.py) of a model's `panoptic_seg` — (ids [H, W], segments_info with contiguous
    category ids), or segments_info None with ids category · label_divisor + instance and -1 void, as detectron2's
    COCOPanopticEvaluator reads it — against the records' `pan_seg_file_name` and `segments_info` (detectron2's
    COCO-panoptic records). The categories are the metadata's things and stuff (contiguous ids)."""

    def __init__(self, dataset_name: str):
        from detectron2.data import DatasetCatalog, MetadataCatalog

        meta = MetadataCatalog.get(dataset_name)
        things = set(meta.thing_dataset_id_to_contiguous_id.values())
        stuff = set(getattr(meta, "stuff_dataset_id_to_contiguous_id", {}).values())
        self.categories = {c: c in things for c in sorted(things | stuff)}
        self._label_divisor = int(getattr(meta, "label_divisor", 1000))
        self._truth = {r["image_id"]: (r["pan_seg_file_name"], r["segments_info"])
                       for r in DatasetCatalog.get(dataset_name) if "pan_seg_file_name" in r}
        self.reset()

    def reset(self) -> None:
        self._stats: dict[int, pq.Stat] = {}

    def process(self, inputs, outputs) -> None:
        for given, out in zip(inputs, outputs):
            self._stats = pq.accumulate(self._stats, self.picture(given, out))

    def picture(self, given: dict, out: dict) -> dict[int, pq.Stat]:
        """One picture's statistics per category."""
        from PIL import Image

        ids, segments = out["panoptic_seg"]
        ids = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids, np.int64)
        if segments is None:  # detectron2's other convention (see the class's docstring)
            segments = [{"id": int(i) + 1, "category_id": int(i) // self._label_divisor} for i in np.unique(ids)
                        if i != -1]
            ids = ids + 1
        png, truth_segments = self._truth[given["image_id"]]
        truth = pq.rgb_to_id(np.asarray(Image.open(png).convert("RGB")))
        return pq.count(truth, truth_segments, ids, segments)

    def evaluate(self):
        return OrderedDict(panoptic_seg=pq.summary(self._stats, self.categories))


def read_labels(path: str, dtype=int) -> np.ndarray:
    """A semantic ground-truth PNG as SemSegEvaluator reads it: its own reader asks numpy 2 for np.array(copy=False)
    of a Pillow image, which numpy 2 refuses."""
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image, dtype=dtype)  # a copy: the evaluator writes into it


def _semantic_summary(results: dict) -> dict:
    """SemSegEvaluator's figures without its per-class accuracy and boundary IoU (four rows a class: 532 for COCO's
    133): mIoU, fwIoU, mACC, pACC and the IoU of each class."""
    return {k: v for k, v in results.items() if not k.startswith(("ACC-", "BoundaryIoU-", "min(IoU, B-Iou)-"))}


def segmentation_tasks(dataset_name: str) -> tuple[str, ...]:
    """What the segmentation evaluator can score on a dataset, by the ground truth its records carry: "sem_seg"
    (every record has `sem_seg_file_name`), "panoptic_seg" (some have `pan_seg_file_name`), "segm" (some have
    instance annotations)."""
    from detectron2.data import DatasetCatalog

    records = DatasetCatalog.get(dataset_name)
    tasks = (("sem_seg",) if records and all("sem_seg_file_name" in r for r in records) else ()) + \
            (("panoptic_seg",) if any("pan_seg_file_name" in r for r in records) else ()) + \
            (("segm",) if any(r.get("annotations") for r in records) else ())
    if not tasks:
        raise ValueError(f"dataset {dataset_name!r} has no segmentation ground truth (sem_seg_file_name, "
                         "pan_seg_file_name or instance annotations); `d2export synth boxes --segmentation` writes a "
                         "set with all three")
    return tasks


def evaluation_tasks(kind: str, dataset_name: str, outputs) -> tuple[str, ...]:
    """What an evaluator of `kind` scores on a dataset for a model with these graph `outputs`: the segmentation
    evaluator what the ground truth allows; the others boxes, with masks and keypoints where the model returns them
    (keypoints where the dataset names its keypoints)."""
    from detectron2.data import MetadataCatalog

    if kind == "segmentation":
        return segmentation_tasks(dataset_name)
    return ("bbox",) + (("segm",) if "masks" in outputs else ()) + (
        ("keypoints",) if "keypoints" in outputs and MetadataCatalog.get(dataset_name).get("keypoint_names") else ())


class SegmentationEvaluator(DatasetEvaluator):
    """A segmenter's three results, each scored where the dataset has its ground truth (`segmentation_tasks`) and
    the model returned it: `sem_seg` ([K, H, W] scores, read through their argmax) by detectron2's SemSegEvaluator
    (mIoU, fwIoU, mACC, pACC, IoU per class), `panoptic_seg` by PanopticQualityEvaluator (PQ, SQ, RQ, things and
    stuff), `instances` by COCO's evaluator on masks (segm AP; only `image_ids` where given)."""

    def __init__(self, dataset_name: str, image_ids: list | None = None):
        from detectron2.data import MetadataCatalog
        from detectron2.evaluation import COCOEvaluator, SemSegEvaluator

        meta = MetadataCatalog.get(dataset_name)
        self.tasks = segmentation_tasks(dataset_name)
        self._dataset, self._classes = dataset_name, len(getattr(meta, "stuff_classes", ()))
        self._things = set(getattr(meta, "thing_dataset_id_to_contiguous_id", {}).values())
        self._parts: dict[str, DatasetEvaluator] = {}  # keyed by the output each reads
        if "sem_seg" in self.tasks:
            self._parts["sem_seg"] = SemSegEvaluator(dataset_name, distributed=False, output_dir=None,
                                                     sem_seg_loading_fn=read_labels)
        if "panoptic_seg" in self.tasks:
            self._parts["panoptic_seg"] = PanopticQualityEvaluator(dataset_name)
        if "segm" in self.tasks:
            coco = COCOEvaluator(dataset_name, tasks=("segm",), distributed=False, output_dir=None)
            self._parts["instances"] = Over(coco, image_ids) if image_ids is not None else coco
        self.reset()

    def reset(self) -> None:
        self._seen: set[str] = set()
        for part in self._parts.values():
            part.reset()

    def _instances(self, instances):
        """COCO's evaluator reads boxes (Mask2Former's are zeros, the runtime's absent: zeros) and takes every class
        for a thing of the dataset's instance JSON: stuff classes are left out, as they have no instance truth."""
        import torch
        from detectron2.structures import Boxes

        instances = instances.to("cpu")
        if not instances.has("pred_boxes"):
            instances.pred_boxes = Boxes(torch.zeros((len(instances), 4)))
        things = torch.as_tensor(sorted(self._things), dtype=torch.int64)
        return instances[torch.isin(instances.pred_classes.long(), things)]

    def process(self, inputs, outputs) -> None:
        for key, part in self._parts.items():
            pairs = [(given, out) for given, out in zip(inputs, outputs) if key in out]
            if not pairs:
                continue
            self._seen.add(key)
            if key == "sem_seg":
                for _, out in pairs:
                    if out["sem_seg"].shape[0] > self._classes:
                        raise ValueError(f"the model scores {out['sem_seg'].shape[0]} classes per pixel, but dataset "
                                         f"{self._dataset!r} has {self._classes}: evaluate on a set of its classes")
            if key == "instances":
                pairs = [(given, {"instances": self._instances(out["instances"])}) for given, out in pairs]
            part.process([given for given, _ in pairs], [out for _, out in pairs])

    def evaluate(self):
        results = OrderedDict()
        for key, part in self._parts.items():
            if key in self._seen:
                results.update(part.evaluate() or {})
        if "sem_seg" in results:
            results["sem_seg"] = _semantic_summary(results["sem_seg"])
        return results


def build_evaluator(kind: str, dataset_name: str, post: dict[str, Any], tasks: tuple[str, ...], d2cfg: Any,
                    output_dir: str, image_ids: list | None = None) -> DatasetEvaluator:
    """`kind`: "text", "coco" (over `tasks`, and only `image_ids` where given), "segmentation" (what the dataset's
    ground truth allows of mIoU, PQ and mask AP; see SegmentationEvaluator) or "module:Class" (the user's: given the
    dataset name and whichever of cfg, distributed=False, output_dir and tasks its constructor takes)."""
    if kind == "text":
        return TextSpottingEvaluator(dataset_name, post)
    if kind == "segmentation":
        return SegmentationEvaluator(dataset_name, image_ids)
    if kind == "coco":
        from detectron2.evaluation import COCOEvaluator

        coco = COCOEvaluator(dataset_name, tasks=tasks, distributed=False, output_dir=None)
        return Over(coco, image_ids) if image_ids is not None else coco
    module, _, name = kind.partition(":")
    if not name:
        raise ValueError(f"--evaluator {kind!r}: write it as module:Class (or {', '.join(KINDS)})")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--evaluator {kind!r} cannot be loaded: {e}") from None
    offered = {"cfg": d2cfg, "distributed": False, "output_dir": output_dir, "tasks": tasks}
    params = inspect.signature(cls).parameters
    return cls(dataset_name, **{k: v for k, v in offered.items() if k in params})
