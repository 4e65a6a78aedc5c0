"""Panoptic quality as COCO panoptic defines it (Kirillov et al., "Panoptic Segmentation"; panopticapi's pq_compute),
in numpy: panopticapi itself is not on the package registry.

Per picture, a ground-truth segment and a predicted one of the same category match when their IoU is > 0.5 (so each
segment matches at most one), where the union leaves out the predicted segment's pixels on void (id 0 in the
ground truth). Matches are true positives (their IoUs summed); unmatched ground-truth segments false negatives,
except crowd regions (`iscrowd`), which are never matched nor missed; unmatched predicted segments false positives,
except those lying more than half on void or on a crowd region of their category. Per category, over the dataset:

    PQ = ΣIoU / (TP + FP/2 + FN/2)     SQ = ΣIoU / TP     RQ = TP / (TP + FP/2 + FN/2)   (PQ = SQ · RQ)

each averaged over the categories that have any TP, FP or FN: all of them, things only (_th), stuff only (_st).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

VOID = 0
MATCH_IOU = 0.5


@dataclass
class Stat:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    iou: float = 0.0

    def __add__(self, other: Stat) -> Stat:
        return Stat(self.tp + other.tp, self.fp + other.fp, self.fn + other.fn, self.iou + other.iou)


def rgb_to_id(rgb: np.ndarray) -> np.ndarray:
    """A COCO panoptic PNG's pixels (H, W, 3) → segment ids R + 256·G + 256²·B."""
    rgb = np.asarray(rgb, np.int64)
    return rgb[..., 0] + 256 * rgb[..., 1] + 256 * 256 * rgb[..., 2]


def count(truth: np.ndarray, truth_segments: Iterable[Mapping], found: np.ndarray,
          found_segments: Iterable[Mapping]) -> dict[int, Stat]:
    """One picture's TP, FP, FN and summed IoU per category. `truth`, `found`: [H, W] segment ids (0: void; a
    prediction's 0 is simply unassigned); segments: {"id", "category_id", "iscrowd" (truth only, default 0)}.
    Areas are counted on the maps; a predicted segment without pixels is no segment."""
    truth_info = {int(s["id"]): s for s in truth_segments}
    found_info = {int(s["id"]): s for s in found_segments}
    if truth.shape != found.shape:
        raise ValueError(f"panoptic maps of {found.shape} for a picture of {truth.shape}")
    pairs, overlap = np.unique((truth.astype(np.int64) << 32) | found.astype(np.int64), return_counts=True)
    truth_ids, found_ids = (pairs >> 32).tolist(), (pairs & 0xFFFFFFFF).tolist()
    stray = {p for p in found_ids if p != VOID and p not in found_info}
    if stray:
        raise ValueError(f"panoptic map holds segment ids {sorted(stray)} that its segments do not list")
    truth_area, found_area, on_void = defaultdict(int), defaultdict(int), defaultdict(int)
    for g, p, n in zip(truth_ids, found_ids, overlap.tolist()):
        truth_area[g] += n
        found_area[p] += n
        if g == VOID:
            on_void[p] += n
    stats: dict[int, Stat] = defaultdict(Stat)
    matched_truth, matched_found = set(), set()
    for g, p, n in zip(truth_ids, found_ids, overlap.tolist()):
        if g not in truth_info or p not in found_info or truth_info[g].get("iscrowd", 0):
            continue
        category = int(truth_info[g]["category_id"])
        if category != int(found_info[p]["category_id"]):
            continue
        iou = n / (truth_area[g] + found_area[p] - n - on_void[p])
        if iou > MATCH_IOU:
            stats[category].tp += 1
            stats[category].iou += iou
            matched_truth.add(g)
            matched_found.add(p)
    crowd = defaultdict(set)  # category → its crowd regions' ids
    for g, s in truth_info.items():
        if s.get("iscrowd", 0):
            crowd[int(s["category_id"])].add(g)
        elif g not in matched_truth:
            stats[int(s["category_id"])].fn += 1
    on_crowd = defaultdict(int)
    for g, p, n in zip(truth_ids, found_ids, overlap.tolist()):
        if p in found_info and g in crowd[int(found_info[p]["category_id"])]:
            on_crowd[p] += n
    for p, s in found_info.items():
        if p in matched_found or found_area[p] == 0:
            continue
        if (on_void[p] + on_crowd[p]) / found_area[p] > 0.5:  # mostly on what the truth leaves unlabelled
            continue
        stats[int(s["category_id"])].fp += 1
    return dict(stats)


def accumulate(total: dict[int, Stat], picture: Mapping[int, Stat]) -> dict[int, Stat]:
    for category, stat in picture.items():
        total[category] = total.get(category, Stat()) + stat
    return total


def summary(stats: Mapping[int, Stat], categories: Mapping[int, bool]) -> dict[str, float]:
    """PQ, SQ, RQ (×100) over `categories` ({category: isthing}), over things (_th) and stuff (_st); NaN where no
    category of the group has any TP, FP or FN. Statistics of categories outside `categories` count nowhere (as a
    prediction of a class the dataset does not have)."""
    out = {}
    for suffix, group in (("", None), ("_th", True), ("_st", False)):
        pq = sq = rq = 0.0
        n = 0
        for category, isthing in categories.items():
            s = stats.get(category, Stat())
            if (group is not None and isthing != group) or s.tp + s.fp + s.fn == 0:
                continue
            n += 1
            denominator = s.tp + 0.5 * s.fp + 0.5 * s.fn
            pq += s.iou / denominator
            sq += s.iou / s.tp if s.tp else 0.0
            rq += s.tp / denominator
        for name, value in (("PQ", pq), ("SQ", sq), ("RQ", rq)):
            out[name + suffix] = 100 * value / n if n else math.nan
    return out
