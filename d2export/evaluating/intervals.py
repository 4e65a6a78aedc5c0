"""How sure a difference in accuracy is: the paired bootstrap over pictures.

Two runs over the same pictures differ in a few words here and there; on a couple of hundred pictures those few decide
a point of H-mean either way (the trained micro spotter's int8 heads recipe on three 200-picture sets of one CPU:
end-to-end -1.29, -1.43 and -0.47). So each difference is given with an interval: the pictures are drawn again with
replacement, the same draw for both runs, each run's per-picture statistics summed over the draw and its figures
computed by the evaluator's rule, and the differences' central `LEVEL` share taken. Pictures are the unit because a
picture's words or regions share its drawing, its clutter and its size.

A figure gets an interval where it is a function of statistics summed over pictures (a `Measure`): text spotting's
counts (detection and end-to-end H-mean), the semantic map's confusion (mIoU, as detectron2's SemSegEvaluator
computes it) and panoptic quality's per-class TP, FP, FN and IoU sums (PQ). COCO's AP is not such a function and gets
none.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Callable, Sequence

import numpy as np

from d2export.evaluating import panoptic_quality as pq
from d2export.evaluating.evaluators import (PanopticQualityEvaluator, ground_truth_words, prediction_words,
                                            read_labels, voc_size)
from d2export.evaluating.text_metrics import Counts, count

DRAWS, LEVEL, SEED = 2000, 0.95, 0
TEXT_FIGURES = ("det_hmean", "e2e_hmean")  # the headline ones (evaluators.HEADLINE)


@dataclass
class Measure:
    """Statistics of one picture that sum over pictures, and the rule from their sums to figures."""

    picture: Callable[[object, dict], np.ndarray]  # (Prediction, dataset record) → [statistics]
    figures: Callable[[np.ndarray], dict[str, np.ndarray]]  # [draws, statistics] summed → {"name": [draws]}


def text_figures(sums: np.ndarray) -> dict[str, np.ndarray]:
    """[draws, Counts fields] → detection and end-to-end H-mean per draw, by `Counts.summary`."""
    summary = Counts(*sums.T).summary()
    return {f"text/{k}": summary[k] for k in TEXT_FIGURES}


def text_measure(dataset: str) -> Measure:
    size = voc_size(dataset)

    def picture(prediction, record: dict) -> np.ndarray:
        words = [w for _, w in prediction_words(prediction)]
        return np.array(astuple(count(ground_truth_words(record, size), words)), np.int64)

    return Measure(picture, text_figures)


def semantic_measure(dataset: str) -> Measure:
    """Per class: pixels right, ground-truth pixels, predicted pixels (the ignore label's left out), as
    SemSegEvaluator's confusion matrix holds them; mIoU over the classes with ground truth, as it averages."""
    from detectron2.data import MetadataCatalog

    meta = MetadataCatalog.get(dataset)
    classes, ignore = len(meta.stuff_classes), int(getattr(meta, "ignore_label", 255))

    def picture(prediction, record: dict) -> np.ndarray:
        truth = read_labels(record["sem_seg_file_name"])
        said = np.asarray(prediction.semantic, np.int64)
        kept = truth != ignore
        confusion = np.bincount(said[kept] * classes + truth[kept], minlength=classes * classes)
        confusion = confusion[:classes * classes].reshape(classes, classes)  # [predicted, true]
        return np.concatenate([np.diag(confusion), confusion.sum(0), confusion.sum(1)])

    def figures(sums: np.ndarray) -> dict[str, np.ndarray]:
        right, truth, said = (sums[:, k * classes:(k + 1) * classes].astype(np.float64) for k in range(3))
        union = truth + said - right
        valid = (truth > 0) & (union > 0)
        iou = np.divide(right, union, out=np.zeros_like(right), where=valid)
        return {"sem_seg/mIoU": 100 * iou.sum(1) / np.maximum(valid.sum(1), 1)}

    return Measure(picture, figures)


def panoptic_measure(dataset: str) -> Measure:
    """Per category: TP, FP, FN and summed IoU of one picture (panoptic_quality.count, as the evaluator counts)."""
    from d2export.evaluating.convert import to_outputs

    evaluator = PanopticQualityEvaluator(dataset)
    categories = evaluator.categories
    order = sorted(categories)

    def picture(prediction, record: dict) -> np.ndarray:
        stats = evaluator.picture(record, to_outputs(prediction, {"instance_on": False}))
        return np.array([[getattr(stats.get(c, pq.Stat()), f) for f in ("tp", "fp", "fn", "iou")] for c in order],
                        np.float64).reshape(-1)

    def figures(sums: np.ndarray) -> dict[str, np.ndarray]:
        per = sums.reshape(len(sums), len(order), 4)
        return {"panoptic_seg/PQ": np.array([pq.summary({c: pq.Stat(*row) for c, row in zip(order, draw)},
                                                        categories)["PQ"] for draw in per])}

    return Measure(picture, figures)


def measures(kind: str, dataset: str, tasks: Sequence[str], metrics: dict[str, float]) -> list[Measure]:
    """The measures an evaluator of `kind` has on `dataset`, for the figures a run reported (`metrics`)."""
    if kind == "text":
        return [text_measure(dataset)]
    if kind != "segmentation":
        return []
    found = []
    if "sem_seg" in tasks and "sem_seg/mIoU" in metrics:
        found.append(semantic_measure(dataset))
    if "panoptic_seg" in tasks and "panoptic_seg/PQ" in metrics:
        found.append(panoptic_measure(dataset))
    return found


def statistics(found: Sequence[Measure], run, records: Sequence[dict]) -> list[np.ndarray]:
    """Per measure, [pictures, statistics] of one run (runs.Run: its predictions in record order)."""
    return [np.stack([m.picture(p, r) for p, r in zip(run.predictions, records)]) for m in found]


def draws(pictures: int, n: int = DRAWS, seed: int = SEED) -> np.ndarray:
    """[n, pictures]: how many times each picture is drawn, in each of `n` draws of `pictures` with replacement."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(pictures, np.full(pictures, 1.0 / pictures), size=n)


def paired(reference: np.ndarray, other: np.ndarray, figures: Callable[[np.ndarray], dict[str, np.ndarray]],
           n: int = DRAWS, level: float = LEVEL, seed: int = SEED) -> dict[str, dict[str, float]]:
    """Per figure, named as the report names it ("text/e2e_hmean"): `other`'s difference from `reference` on all
    pictures and the interval holding `level` of the differences over `n` paired draws ({"delta", "low", "high"})."""
    if len(reference) != len(other) or not len(reference):
        raise ValueError(f"paired runs need the same pictures ({len(reference)} and {len(other)})")
    weights = draws(len(reference), n, seed)
    a, b = figures(weights @ reference), figures(weights @ other)
    whole_a, whole_b = figures(reference.sum(0)[None]), figures(other.sum(0)[None])
    tail = 100 * (1 - level) / 2
    out = {}
    for name in a:
        low, high = np.nanpercentile(b[name] - a[name], [tail, 100 - tail])
        out[name] = {"delta": float(whole_b[name][0] - whole_a[name][0]), "low": float(low), "high": float(high)}
    return out


def compared(found: Sequence[Measure], reference: list[np.ndarray], other: list[np.ndarray]
             ) -> dict[str, dict[str, float]]:
    """Every measure's intervals of one run's `statistics` against the reference run's."""
    out = {}
    for m, a, b in zip(found, reference, other):
        out |= paired(a, b, m.figures)
    return out


def line(name: str, found: dict[str, dict[str, float]], pictures: int, level: float = LEVEL) -> str:
    """'Δ int8, 95% interval (paired bootstrap over 200 pictures): text/det_hmean -0.15 [-0.92, +0.61], …'."""
    def signed(x: float) -> str:
        return f"{round(x, 6) + 0.0:+.2f}"  # float noise (-1e-15) reads +0.00, not -0.00

    said = ", ".join(f"{k} {signed(v['delta'])} [{signed(v['low'])}, {signed(v['high'])}]" for k, v in found.items())
    return f"Δ {name}, {level:.0%} interval (paired bootstrap over {pictures} pictures): {said}"
