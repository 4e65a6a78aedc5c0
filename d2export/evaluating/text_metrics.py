"""Text spotting metrics as TotalText's protocol counts them (torch-free: polygons and strings).

Detection: a detection and a ground-truth word match when their polygons' IoU exceeds 0.5 (strictly, as the
ICDAR/TotalText scripts compare); each matches at most once, the pairs taken by descending IoU. Words transcribed
'###' are "don't care": they count for neither side, and a detection lying mostly (over half its area) on one is
set aside. End-to-end (no lexicon): a matched pair counts when the transcriptions are equal ignoring case.
Precision = matches / detections, recall = matches / words, H-mean their harmonic mean, in percent. Character accuracy
(not TotalText's; it shows recognition learning before whole words come out right): 1 - the edits from the matched
detections' transcriptions to their words, each word's at most its length, over the words' characters.

Polygon areas come from shapely (the library AdelaiDet's evaluation uses); an invalid (self-crossing) polygon, as an
untrained model draws, is repaired with `make_valid` rather than dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

DONT_CARE = "###"
IOU = 0.5


@dataclass
class Word:
    points: np.ndarray  # (n, 2) outline
    text: str = ""


@dataclass
class Counts:
    words: int = 0  # ground truth, don't-care words left out
    detections: int = 0  # detections, those set aside on don't-care words left out
    matched: int = 0  # detection matches
    read: int = 0  # matches whose transcription is right
    chars: int = 0  # characters of the matched words
    char_errors: int = 0  # edits from their transcriptions to them (ignoring case), at most each word's length

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def summary(self) -> dict[str, float]:
        """The figures, in percent. Fields may also be arrays (one set of counts per bootstrap draw,
        `intervals.py`): each figure is then an array, by the same rule."""
        def ratio(a, b):
            b = np.asarray(b, np.float64)
            return np.divide(100.0 * np.asarray(a), b, out=np.zeros_like(b), where=b > 0)

        def hmean(p, r):
            return np.divide(2 * p * r, p + r, out=np.zeros_like(p), where=p + r > 0)

        dp, dr = ratio(self.matched, self.detections), ratio(self.matched, self.words)
        ep, er = ratio(self.read, self.detections), ratio(self.read, self.words)
        figures = {"det_precision": dp, "det_recall": dr, "det_hmean": hmean(dp, dr),
                   "e2e_precision": ep, "e2e_recall": er, "e2e_hmean": hmean(ep, er),
                   "char_accuracy": ratio(np.asarray(self.chars) - self.char_errors, self.chars)}
        figures = {k: float(v) if np.ndim(v) == 0 else v for k, v in figures.items()}
        return figures | {"words": self.words, "detections": self.detections}


def edits(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions): a few lines for words of at most 25 characters
    rather than a dependency."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def shape(points: np.ndarray):
    from shapely import make_valid
    from shapely.geometry import Polygon

    p = Polygon(np.asarray(points, dtype=np.float64).reshape(-1, 2))
    return p if p.is_valid else make_valid(p)


def iou(a, b) -> float:
    inter = a.intersection(b).area
    union = a.area + b.area - inter
    return inter / union if union > 0 else 0.0


def read_pair(truth: str, said: str) -> Counts:
    """One matched pair's counts: whether `said` reads `truth` whole, and its edits to it (ignoring case)."""
    truth, said = truth.upper(), said.upper()
    return Counts(matched=1, read=int(truth == said), chars=len(truth), char_errors=min(edits(said, truth), len(truth)))


def matches(words: Sequence[Word], detections: Sequence[Word]) -> tuple[list[tuple[int, int]], int]:
    """One picture's matched (word, detection) index pairs, and how many detections count (those lying on a don't-care
    word set aside)."""
    gts = [shape(w.points) for w in words]
    dets = [shape(d.points) for d in detections]
    care = [w.text != DONT_CARE for w in words]
    kept = [j for j, d in enumerate(dets)
            if not any(not c and d.area > 0 and d.intersection(g).area / d.area > IOU for g, c in zip(gts, care))]
    pairs = sorted(((iou(gts[i], dets[j]), i, j) for i in range(len(gts)) if care[i] for j in kept),
                   key=lambda t: (-t[0], t[1], t[2]))
    used_g, used_d, matched = set(), set(), []
    for value, i, j in pairs:
        if value <= IOU:
            break
        if i in used_g or j in used_d:
            continue
        used_g.add(i)
        used_d.add(j)
        matched.append((i, j))
    return matched, len(kept)


def count(words: Sequence[Word], detections: Sequence[Word]) -> Counts:
    """One picture's counts."""
    matched, kept = matches(words, detections)
    reading = sum((read_pair(words[i].text, detections[j].text) for i, j in matched), Counts())
    return reading + Counts(words=sum(w.text != DONT_CARE for w in words), detections=kept)
