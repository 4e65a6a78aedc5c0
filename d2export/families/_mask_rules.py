"""A mask-classification model's own rules from class logits to class scores, numpy only: Mask2Former's softmax with
its "no object" class, MaskDINO's sigmoids, OneFormer's instance filters (`Rules`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float32)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    out = np.negative(np.asarray(x, np.float32))
    with np.errstate(over="ignore"):  # exp(-x) → inf for x < -88: the probability is 0, as torch's
        np.exp(out, out=out)
    out += 1
    return np.reciprocal(out, out=out)


@dataclasses.dataclass(frozen=True)
class Rules:
    """A model's own rules from class logits to results, where they differ from Mask2Former's (a softmax whose last
    class is "no object"). MaskDINO's (`sigmoid`): a sigmoid per class, K of them; with `transform_eval` panoptic and
    semantic scores are a softmax of the sigmoids at `temperature`; `semantic_ce_loss` (semantic-only models trained
    with cross-entropy) scores semantic classes by a softmax without its last column, as MaskDINO writes it;
    `focus_on_box` scores instances by their class alone. OneFormer's: `min_class_score` (its demo mode) keeps the
    instance pairs whose class scores more; `label_ids` (its ADE20K instance task) turns an instance's class into its
    place among the thing classes' dataset ids; `boxes_from_masks` (its DETECTION_ON) boxes each instance mask."""

    sigmoid: bool = False
    transform_eval: bool = False
    temperature: float = 1.0
    semantic_ce_loss: bool = False
    focus_on_box: bool = False
    min_class_score: float | None = None
    label_ids: tuple[int, ...] = ()
    boxes_from_masks: bool = False

    @classmethod
    def of(cls, post: dict[str, Any]) -> "Rules":
        oneformer = {"min_class_score": post.get("instance_min_score"),
                     "label_ids": tuple(int(i) for i in post.get("instance_label_ids") or ()),
                     "boxes_from_masks": bool(post.get("boxes_from_masks", False))}
        if post.get("class_scores", "softmax") == "softmax":
            return cls(**oneformer)
        if post["class_scores"] != "sigmoid":
            raise ValueError(f"class_scores {post['class_scores']!r}: softmax or sigmoid")
        missing = [k for k in ("transform_eval", "panoptic_temperature", "semantic_ce_loss", "focus_on_box")
                   if k not in post]
        if missing:
            raise ValueError(f"the manifest's postprocess has no {', '.join(map(repr, missing))} (MaskDINO's "
                             "MODEL.MaskDINO.TEST; export it again)")
        return cls(True, bool(post["transform_eval"]), float(post["panoptic_temperature"]),
                   bool(post["semantic_ce_loss"]), bool(post["focus_on_box"]))

    @property
    def extra(self) -> int:
        """Class columns past the K classes."""
        return 0 if self.sigmoid else 1

    def _sharpened(self, mask_cls: np.ndarray) -> np.ndarray:
        scores = sigmoid(mask_cls)
        return softmax(scores / np.float32(self.temperature)) if self.transform_eval else scores

    def semantic(self, mask_cls: np.ndarray) -> np.ndarray:
        """[Q, K] weights of the mask probabilities per class."""
        if self.sigmoid and not self.semantic_ce_loss:
            return self._sharpened(mask_cls)
        return softmax(mask_cls)[:, :-1]

    def panoptic(self, mask_cls: np.ndarray, num_classes: int, object_mask_threshold: float):
        """The queries kept (best class not "no object", its score > the threshold), their classes and scores."""
        first = sigmoid(mask_cls) if self.sigmoid else softmax(mask_cls)
        labels, scores = first.argmax(-1), first.max(-1)
        keep = np.flatnonzero((labels != num_classes) & (scores > object_mask_threshold))
        if self.sigmoid and self.transform_eval:  # kept by the sigmoids, scored by the sharpened ones
            sharp = self._sharpened(mask_cls)
            labels, scores = sharp.argmax(-1), sharp.max(-1)
        return keep, labels[keep], scores[keep]

    def instance(self, mask_cls: np.ndarray) -> np.ndarray:
        """[Q, K] class scores the top-k is taken over."""
        return sigmoid(mask_cls) if self.sigmoid else softmax(mask_cls)[:, :-1]
