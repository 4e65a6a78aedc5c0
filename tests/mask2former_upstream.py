"""Mask2Former's three inference rules, transcribed for the tests from upstream's
facebookresearch/Mask2Former `mask2former/maskformer_model.py` (MaskFormer.forward's eval branch, semantic_inference,
panoptic_inference, instance_inference) in plain numpy, float64, one picture at a time, as upstream loops: nothing
here calls d2export, so the served rules (d2export/families/_mask_*.py) and the in-graph ones
(d2export/tracing/mask_results.py) are held to something they do not share.

`head_outputs` makes random head outputs with the cases each rule decides: queries sure of a class, unsure ones
(best probability between 0.5 and the object threshold), "no object" ones whose second class would pass the
threshold, and blob masks that overlap so that some segments keep less of their mask than the overlap threshold.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

K, Q = 9, 16  # classes before "no object", queries
THINGS = (0, 1, 2, 3, 4)  # contiguous ids of the thing classes; 5..8 are stuff
OBJECT_MASK_THRESHOLD, OVERLAP_THRESHOLD, TOPK = 0.8, 0.8, 24


def post_dict(semantic=True, panoptic=True, instance=True) -> dict:
    """d2export's postprocess section for these rules' settings (before inference, as panoptic/instance force)."""
    return {"num_classes": K, "object_mask_threshold": OBJECT_MASK_THRESHOLD, "overlap_threshold": OVERLAP_THRESHOLD,
            "test_topk_per_image": TOPK, "semantic_on": semantic, "panoptic_on": panoptic, "instance_on": instance,
            "sem_seg_postprocess_before_inference": True, "thing_ids": list(THINGS),
            "class_names": [f"c{i}" for i in range(K)], "class_scores": "softmax"}


def head_outputs(seed: int, n: int, mask_hw: tuple[int, int]) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    logits = g.normal(0, 1, (n, Q, K + 1)).astype(np.float32)
    for i in range(n):
        for j in range(Q):
            role = g.choice(["sure", "unsure", "none"], p=[0.6, 0.2, 0.2])
            if role == "sure":
                logits[i, j, g.integers(K)] += g.uniform(5, 8)
            elif role == "unsure":  # best probability ~0.5-0.8: kept only by a lower threshold
                logits[i, j, g.integers(K)] += g.uniform(2.5, 3.5)
            else:  # "no object" first, a real class second and sure among the real ones
                logits[i, j, K] += 9
                logits[i, j, g.integers(K)] += 8
    mh, mw = mask_hw
    y, x = np.mgrid[0:mh, 0:mw].astype(np.float32)
    masks = np.empty((n, Q, mh, mw), np.float32)
    for i in range(n):
        cells = g.permutation(Q)  # a 4x4 grid, a cell per query: blobs spill into their neighbours' now and then
        for j in range(Q):
            cy, cx = (cells[j] // 4 + g.uniform(0.3, 0.7)) * mh / 4, (cells[j] % 4 + g.uniform(0.3, 0.7)) * mw / 4
            ry, rx = g.uniform(0.4, 1.3) * mh / 4, g.uniform(0.4, 1.3) * mw / 4
            d = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
            masks[i, j] = g.uniform(2, 8) * (1 - d) + g.normal(0, 0.7, (mh, mw))
    return {"pred_logits": logits, "pred_masks": masks}


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * np.asarray(x, np.float64)))  # 1 / (1 + exp(-x)) without overflow


def semantic_inference(mask_cls: np.ndarray, mask_pred: np.ndarray) -> np.ndarray:
    """[K, H, W]: softmax over K + 1 classes, "no object" dropped, times the mask probabilities, summed over
    queries."""
    return np.einsum("qc,qhw->chw", _softmax(mask_cls)[:, :-1], _sigmoid(mask_pred))


def panoptic_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, num_classes: int = K,
                       object_mask_threshold: float = OBJECT_MASK_THRESHOLD,
                       overlap_threshold: float = OVERLAP_THRESHOLD, things=THINGS):
    """([H, W] segment ids, 0 none; [(id, category, isthing)]), upstream's walk over the kept queries."""
    probs = _softmax(mask_cls)
    scores, labels = probs.max(-1), probs.argmax(-1)
    masks = _sigmoid(mask_pred)
    keep = (labels != num_classes) & (scores > object_mask_threshold)
    cur_scores, cur_classes, cur_masks = scores[keep], labels[keep], masks[keep]
    seg = np.zeros(mask_pred.shape[-2:], np.int32)
    segments = []
    if not keep.any():
        return seg, segments
    ids = (cur_scores[:, None, None] * cur_masks).argmax(0)
    stuff, current = {}, 0
    for k, c in enumerate(cur_classes.tolist()):
        isthing = c in things
        mask_area = int((ids == k).sum())
        original_area = int((cur_masks[k] >= 0.5).sum())
        mask = (ids == k) & (cur_masks[k] >= 0.5)
        if mask_area > 0 and original_area > 0 and mask.sum() > 0:
            if mask_area / original_area < overlap_threshold:
                continue
            if not isthing:
                if c in stuff:
                    seg[mask] = stuff[c]
                    continue
                stuff[c] = current + 1
            current += 1
            seg[mask] = current
            segments.append((current, c, isthing))
    return seg, segments


def instance_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, num_classes: int = K, topk: int = TOPK,
                       panoptic_on: bool = True, things=THINGS) -> list[tuple[int, float, np.ndarray]]:
    """[(class, score, mask)]: the top-k (query, class) pairs over K classes, things only when panoptic is on, the
    mask where the logit is > 0, scored class probability × the mask's mean probability over its pixels."""
    flat = _softmax(mask_cls)[:, :-1].reshape(-1)
    top = np.argsort(-flat, kind="stable")[:topk]
    found = []
    for index in top.tolist():
        query, label = divmod(index, num_classes)
        if panoptic_on and label not in things:
            continue
        mask = mask_pred[query] > 0
        mean = (_sigmoid(mask_pred[query]) * mask).sum() / (mask.sum() + 1e-6)
        found.append((label, float(flat[index] * mean), mask))
    return found


def forward(outputs: dict[str, np.ndarray], index: int, image_hw: tuple[int, int], post: dict) -> dict:
    """MaskFormer.forward's eval branch for one picture asked at its own size: the head's masks upsampled bilinearly
    to the padded batch, cropped to the picture (sem_seg_postprocess before inference; the resize to the same size
    is the identity), then each task's rule."""
    pred = torch.from_numpy(outputs["pred_masks"][index][None])
    padded = F.interpolate(pred, size=(pred.shape[2] * 4, pred.shape[3] * 4), mode="bilinear", align_corners=False)
    h, w = image_hw
    masks, cls = padded[0, :, :h, :w].numpy(), outputs["pred_logits"][index]
    out = {}
    if post["semantic_on"]:
        out["semantic"] = semantic_inference(cls, masks).argmax(0)
    if post["panoptic_on"]:
        out["panoptic"] = panoptic_inference(cls, masks, post["num_classes"], post["object_mask_threshold"],
                                             post["overlap_threshold"], tuple(post["thing_ids"]))
    if post["instance_on"]:
        out["instances"] = instance_inference(cls, masks, post["num_classes"], post["test_topk_per_image"],
                                              post["panoptic_on"], tuple(post["thing_ids"]))
    return out
