"""How sure a difference in accuracy is: the paired bootstrap over pictures.

Two runs over the same pictures differ in a few words here and there; on a couple of hundred pictures those few decide
a point of H-mean either way (the trained micro spotter's int8 heads recipe on three 200-picture sets of one CPU:
end-to-end -1.29, -1.43 and -0.47). So each difference is given with an interval: the pictures are drawn again with
replacement, the same draw for both runs, each run's counts summed over the draw and its figures computed by the
evaluator's own rule (`Counts.summary`), and the differences' central `LEVEL` share taken. Pictures are the unit
because a picture's words share its drawing, its clutter and its size. Text spotting for now: its figures are sums
over pictures; COCO's AP and the segmentation figures are not summed so and get no interval here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from d2export.evaluating.evaluators import ground_truth_words, prediction_words, voc_size
from d2export.evaluating.text_metrics import Counts, count

DRAWS, LEVEL, SEED = 2000, 0.95, 0
TEXT_FIGURES = ("det_hmean", "e2e_hmean")  # the headline ones (evaluators.HEADLINE)


def text_counts(predictions: Sequence, records: Sequence[dict], dataset: str) -> np.ndarray:
    """[pictures, Counts fields]: each picture's counts, as the text evaluator counts them."""
    size = voc_size(dataset)
    return np.array([count(ground_truth_words(record, size), [w for _, w in prediction_words(p)]).as_row()
                     for p, record in zip(predictions, records)], np.int64).reshape(len(records), -1)


def draws(pictures: int, n: int = DRAWS, seed: int = SEED) -> np.ndarray:
    """[n, pictures]: how many times each picture is drawn, in each of `n` draws of `pictures` with replacement."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(pictures, np.full(pictures, 1.0 / pictures), size=n)


def paired(reference: np.ndarray, other: np.ndarray, figures: Sequence[str] = TEXT_FIGURES, n: int = DRAWS,
           level: float = LEVEL, seed: int = SEED) -> dict[str, dict[str, float]]:
    """Per figure, named as the report names it ("text/e2e_hmean"): `other`'s difference from `reference` on all
    pictures and the interval holding `level` of the differences over `n` paired draws ({"delta", "low", "high"})."""
    if len(reference) != len(other) or not len(reference):
        raise ValueError(f"paired runs need the same pictures ({len(reference)} and {len(other)})")
    weights = draws(len(reference), n, seed)
    a, b = Counts(*(weights @ reference).T).summary(), Counts(*(weights @ other).T).summary()
    whole_a, whole_b = Counts(*reference.sum(0)).summary(), Counts(*other.sum(0)).summary()
    tail = 100 * (1 - level) / 2
    out = {}
    for name in figures:
        low, high = np.percentile(b[name] - a[name], [tail, 100 - tail])
        out[f"text/{name}"] = {"delta": float(whole_b[name] - whole_a[name]), "low": float(low), "high": float(high)}
    return out


def line(name: str, found: dict[str, dict[str, float]], pictures: int, level: float = LEVEL) -> str:
    """'Δ int8, 95% interval (paired bootstrap over 200 pictures): text/det_hmean -0.15 [-0.92, +0.61], …'."""
    said = ", ".join(f"{k} {v['delta']:+.2f} [{v['low']:+.2f}, {v['high']:+.2f}]" for k, v in found.items())
    return f"Δ {name}, {level:.0%} interval (paired bootstrap over {pictures} pictures): {said}"
