"""Mask2Former's post-processing as graph operations (`export.postprocess=graph`): the masks upsampled to the padded
batch and each task's per-pixel work done where the graph runs (a CUDA session keeps them on the GPU), from the
head's `pred_logits` and `pred_masks`, at any size and batch. Results are a picture's as the model's own inference
functions give them at the picture's size in the graph (its top-left corner of the padded batch); serving
(d2export/families/_mask_predictions.py `graph_prediction`) crops them, walks the panoptic segments, encodes the
instance masks and maps them to the original picture.

Outputs, by the config's tasks (`post`: the manifest's postprocess section, as d2export/families/_mask_predictions.py
reads it):
- semantic: `sem_seg` [N, Hp, Wp] int64, semantic_inference's argmax;
- panoptic: `panoptic_query` [N, Hp, Wp] int64, the kept query whose score × probability is highest where its own
  mask covers the pixel (probability >= 0.5), else -1; `query_keep` [N, Q] bool, `query_labels` [N, Q] int64 and
  `query_areas` [N, Q, 3] int64 (per query inside the picture: pixels it wins, its mask's pixels, pixels it wins and
  covers): what panoptic_inference's walk over the kept queries reads;
- instance: `instance_scores`, `instance_labels`, `instance_queries` [N, k] (the top-k (query, class) pairs by class
  score, k = test_topk_per_image, scored by the mask's mean probability inside the picture) and `instance_masks`
  [N, Q, Hp, Wp] bool (logit > 0).
The class scores follow the model's rules (Mask2Former's softmax with "no object", MaskDINO's sigmoid and
temperature), as the numpy `Rules` does.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

MASK_STRIDE = 4


def _sharpened(logits: Tensor, post: dict[str, Any]) -> Tensor:
    scores = logits.sigmoid()
    return F.softmax(scores / float(post["panoptic_temperature"]), -1) if post["transform_eval"] else scores


def _sigmoid(post: dict[str, Any]) -> bool:
    return post.get("class_scores", "softmax") == "sigmoid"


# The rules, one function each (tests alter one at a time and show that verification refuses it:
# tests/test_mask_rules_upstream.py); each as families/_mask_rules.py's `Rules` writes it in numpy.
def semantic_classes(pred_logits: Tensor, post: dict[str, Any]) -> Tensor:
    """[N, Q, K] weights of the mask probabilities per class: softmax without "no object" (MaskDINO: its sigmoids)."""
    if _sigmoid(post) and not post["semantic_ce_loss"]:
        return _sharpened(pred_logits, post)
    return F.softmax(pred_logits, -1)[..., :-1]


def kept_queries(pred_logits: Tensor, post: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """Panoptic: (keep, scores, labels) [N, Q]: a query is kept where its best class (over K + 1, "no object"
    included) is not "no object" and its probability is > object_mask_threshold."""
    sigmoid = _sigmoid(post)
    first = pred_logits.sigmoid() if sigmoid else F.softmax(pred_logits, -1)
    scores, labels = first.max(-1)
    keep = (labels != int(post["num_classes"])) & (scores > float(post["object_mask_threshold"]))
    if sigmoid and post["transform_eval"]:
        scores, labels = _sharpened(pred_logits, post).max(-1)
    return keep, scores, labels


def instance_classes(pred_logits: Tensor, post: dict[str, Any]) -> Tensor:
    """Instance: [N, Q, K] class scores the top-k is taken over (softmax without "no object"; MaskDINO: sigmoids)."""
    return pred_logits.sigmoid() if _sigmoid(post) else F.softmax(pred_logits, -1)[..., :-1]


def instance_scores(class_scores: Tensor, mask_scores: Tensor, post: dict[str, Any]) -> Tensor:
    """Instance: a pair's score, its class score × its mask's mean probability over its pixels (MaskDINO's
    focus_on_box: the class score alone)."""
    return class_scores if post.get("focus_on_box") else class_scores * mask_scores


def results(pred_logits: Tensor, pred_masks: Tensor, image_sizes: Tensor, post: dict[str, Any]) -> dict[str, Tensor]:
    n, q = pred_logits.shape[:2]
    masks = F.interpolate(pred_masks, size=(pred_masks.shape[2] * MASK_STRIDE, pred_masks.shape[3] * MASK_STRIDE),
                          mode="bilinear", align_corners=False)
    probs = masks.sigmoid()
    rows = torch.arange(masks.shape[2], device=masks.device)[None, :, None] < image_sizes[:, 0, None, None]
    cols = torch.arange(masks.shape[3], device=masks.device)[None, None, :] < image_sizes[:, 1, None, None]
    inside = (rows & cols)[:, None]  # [N, 1, Hp, Wp]: the picture's own pixels
    out = {}
    if post["semantic_on"]:
        out["sem_seg"] = torch.einsum("nqc,nqhw->nchw", semantic_classes(pred_logits, post), probs).argmax(1)
    if post["panoptic_on"]:
        keep, scores, labels = kept_queries(pred_logits, post)
        # queries not kept never win: their products are below every kept one's (>= 0)
        products = torch.where(keep[:, :, None, None], scores[:, :, None, None] * probs, -1.0)
        winner = products.argmax(1, keepdim=True)  # [N, 1, Hp, Wp]
        covered = (probs.gather(1, winner) >= 0.5) & keep.any(1)[:, None, None, None]
        won = winner == torch.arange(q, device=masks.device)[None, :, None, None]  # [N, Q, Hp, Wp]
        areas = [(won & inside).sum((2, 3)), ((probs >= 0.5) & inside).sum((2, 3)),
                 (won & covered & inside).sum((2, 3))]
        out |= {"panoptic_query": torch.where(covered, winner, -1)[:, 0], "query_keep": keep, "query_labels": labels,
                "query_areas": torch.stack(areas, -1)}
    if post["instance_on"]:
        per_class = instance_classes(pred_logits, post)
        k = min(int(post["test_topk_per_image"]), q * per_class.shape[-1])
        top_scores, top = per_class.flatten(1).topk(k, dim=1)
        queries = torch.div(top, per_class.shape[-1], rounding_mode="floor")
        positive = masks > 0
        mine = (positive & inside).float()
        mean = (probs * mine).sum((2, 3)) / (mine.sum((2, 3)) + 1e-6)
        out |= {"instance_scores": instance_scores(top_scores, mean.gather(1, queries), post),
                "instance_labels": top % per_class.shape[-1], "instance_queries": queries,
                "instance_masks": positive}
    return out
