"""Serving-side post-processing of mask-classification models (Mask2Former, MaskFormer), numpy only: what
Mask2Former's `MaskFormer.forward` does at inference after its head, on the graph's outputs, so a served model
answers as the PyTorch model does (to float32 rounding).

Per picture, from `pred_logits` [Q, K+1] (the last class is "no object") and `pred_masks` [Q, Hp/4, Wp/4] mask
logits over the batch's padded size (Hp, Wp):
  1. the masks upsampled bilinearly (align_corners=False) to (Hp, Wp); with `sem_seg_postprocess_before_inference`,
     cropped to the picture's size in the graph (h, w) and resized to the original (H, W) (`sem_seg_postprocess`);
  2. `semantic_inference`: per-class scores softmax(classes)[:, :-1] · sigmoid(masks) → [K, ·, ·] (postprocessed to
     (H, W) afterwards where step 1 did not); `Prediction.semantic` is their argmax;
  3. `panoptic_inference`: confident queries' masks compete per pixel; segments too covered are dropped, stuff
     segments of one class merged;
  4. `instance_inference`: the top-k (query, class) pairs, things only when panoptic is on, masks where the logit is
     > 0, scored class probability × the mask's mean probability.

Upstream's from_config turns postprocessing before inference on whenever panoptic or instance results are; were it
off, upstream's panoptic map and instance masks would be in padded input pixels: d2export computes them there (the
same segments, instances and scores) and then maps them to the original picture (cropped to (h, w), resized
nearest), so a `Prediction`'s maps are always the original picture's size.

The manifest's post-processing section (`post`), as `mask_prediction` reads it (MODEL.MASK_FORMER.TEST.* in
Mask2Former's config; every key but class_names required where it is used, none guessed):
  num_classes                           K, the classes before "no object" (pred_logits' last axis is K + 1;
                                        MODEL.SEM_SEG_HEAD.NUM_CLASSES)
  semantic_on, panoptic_on, instance_on which results to make (SEMANTIC_ON, PANOPTIC_ON, INSTANCE_ON)
  sem_seg_postprocess_before_inference  resize the masks to the original picture before inference, else the
                                        semantic scores after it (SEM_SEG_POSTPROCESSING_BEFORE_INFERENCE)
  object_mask_threshold                 panoptic: a query is kept when its best class is not "no object" and its
                                        probability is > this (OBJECT_MASK_THRESHOLD)
  overlap_threshold                     panoptic: a segment is dropped when it keeps < this fraction of its own
                                        mask (OVERLAP_THRESHOLD)
  thing_ids                             panoptic (and instance, when panoptic is on): contiguous class ids that are
                                        things (the dataset metadata's thing_dataset_id_to_contiguous_id values);
                                        the others are stuff
  test_topk_per_image                   instance: (query, class) pairs kept (TEST.DETECTIONS_PER_IMAGE)
  class_names                           contiguous class id → name, for segments and instances (optional)
  class_scores                          "softmax" (Mask2Former, OneFormer; the default) or "sigmoid" (MaskDINO: K
                                        classes, no "no object"; `pred_boxes` give the instances' boxes), and then:
  transform_eval, panoptic_temperature  MaskDINO: panoptic and semantic class scores a softmax of the sigmoids at
                                        this temperature (PANO_TRANSFORM_EVAL, PANO_TEMPERATURE)
  semantic_ce_loss                      MaskDINO: semantic classes by a softmax without its last column (as its
                                        from_config sets it: SEMANTIC_ON, SEMANTIC_CE_LOSS and not PANOPTIC_ON)
  focus_on_box                          MaskDINO: instances scored by their class alone (TEST_FOUCUS_ON_BOX)
"""
from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
from threadpoolctl import ThreadpoolController

from d2export.instances import Instance, Prediction, Segment, encode_mask

MASK_STRIDE = 4  # pred_masks is over the padded batch at 1/4 of its size (the pixel decoder's finest level)
_RESIZE_CHUNK = 1 << 20  # float32 elements a resize step holds per map group: small enough to stay in cache
_BAND = 1 << 19  # float32 elements of mask probabilities per band of rows: a band is made, used and dropped in cache
# Class probabilities below float32's normal range (a softmax over logits 87+ apart: seeded weights make thousands)
# cost 40-80x a multiply on Intel cores (microcode assists; on AMD's barely more): the semantic product of 640² took
# 7.7 s instead of 0.1. Lifted by 2^LIFT, both factors are normal; products and sums round exactly as the unlifted
# ones wherever those are normal (a power of two commutes with rounding) and better where those underflow (scores
# under 1e-38, whose order the 1e-4 tie rule already leaves to noise); the argmax is the same. (The graph's product,
# export.postprocess=graph, stays unlifted: verification pins its ArgMax by absolute gaps; GPUs take subnormals.)
# A product by 2^LIFT is the lift: exact for every float32 up to 1, and a tenth of np.ldexp's time (a libm call per
# element; 13 ms of a 2.6 M-element band on an AMD EPYC, more than the band's product).
LIFT = 48
_LIFTED = np.float32(2.0 ** LIFT)


# export.postprocess=graph: what the graph computes per task (d2export/tracing/mask_results.py), served by
# graph_prediction; their kinds for verification and their dynamic axes
GRAPH_OUTPUTS = {"semantic_on": ("sem_seg",),
                 "panoptic_on": ("panoptic_query", "query_keep", "query_labels", "query_areas"),
                 "instance_on": ("instance_scores", "instance_labels", "instance_queries", "instance_masks")}
GRAPH_KINDS = {name: "ids" for names in GRAPH_OUTPUTS.values() for name in names} | {
    "instance_scores": "probabilities"}
_MAP = {0: "batch", 1: "height", 2: "width"}
GRAPH_AXES = {name: {0: "batch"} for name in GRAPH_KINDS} | {
    "sem_seg": _MAP, "panoptic_query": _MAP, "instance_masks": {0: "batch", 2: "height", 3: "width"}}


def graph_output_names(post: dict[str, Any]) -> tuple[str, ...]:
    return tuple(name for task, names in GRAPH_OUTPUTS.items() if post[task] for name in names)


# resizing -------------------------------------------------------------------------------------------------------------
# Bilinear resizes as a few taps per output along each axis, gathered with np.take: the cost is the output's size
# whatever the scale, single-threaded like torch's own CPU kernel and about as fast (Q=100 masks to 800x1088: 0.5 s;
# 150 class maps 512x683 to 1024x1366: 2 s). Banded weight matrices through BLAS cost 2·span multiply-adds per output
# and, as thousands of small threaded matmuls, stall 10-100x on busy cores.
Taps = tuple  # (index [out, k], weight [out, k]): output i = Σ_j weight[i, j] · input[index[i, j]]


@functools.lru_cache(maxsize=256)
def _taps(size: int, out: int, keep: int | None = None) -> Taps | None:
    """The two taps per output of F.interpolate(mode="bilinear", align_corners=False) from `size` to `out` samples
    along one axis (the first `keep` outputs only, where given); None for the identity."""
    if size == out and keep in (None, out):
        return None
    # torch's own arithmetic (aten's area_pixel_compute_source_index and guard_index_and_lambda): a float32 scale,
    # the source index as one fused multiply-add rounded once to float32 (exact in float64 before that rounding), so
    # the weights are torch's bit for bit; plain float32 steps put them up to 4e-6 off
    scale = np.float64(np.float32(size) / np.float32(out))
    src = np.maximum(scale * (np.arange(out)[:keep] + 0.5) - 0.5, 0).astype(np.float32)
    lo = np.minimum(np.floor(src).astype(np.int64), size - 1)
    frac = np.clip(src - lo.astype(np.float32), 0, 1).astype(np.float32)
    hi = np.where(lo < size - 1, lo + 1, lo)
    return _frozen(np.stack([lo, hi], 1), np.stack([np.float32(1) - frac, frac], 1))


@functools.lru_cache(maxsize=256)
def _then(size: int, out: int, keep: int, after: int) -> Taps | None:
    """Resizing `size` → `out`, keeping the first `keep` outputs and resizing those to `after`, as one set of taps
    (at most four per output: two of two): the large intermediate is never made. Equal to the two steps to float
    rounding."""
    first = _taps(size, out, keep)
    second = _taps(keep, after)
    if first is None or second is None:
        return first or second
    dense = _dense(second, keep).astype(np.float64) @ _dense(first, size).astype(np.float64)  # [after, size]
    k = max(int(np.count_nonzero(dense, 1).max()), 1)
    # each output's inputs are consecutive: a window of k from the first, kept inside the axis
    start = np.minimum(np.argmax(dense != 0, 1), size - k)
    index = start[:, None] + np.arange(k)
    return _frozen(index, np.take_along_axis(dense, index, 1).astype(np.float32))


def _frozen(index: np.ndarray, weight: np.ndarray) -> Taps:
    for a in (index, weight):
        a.flags.writeable = False  # cached: shared by every caller
    return index, weight


def _dense(taps: Taps | None, size: int) -> np.ndarray:
    if taps is None:
        return np.eye(size, dtype=np.float32)
    index, weight = taps
    w = np.zeros((len(index), size), np.float32)
    np.add.at(w, (np.arange(len(index))[:, None], index), weight)
    return w


def resize_weights(size: int, out: int) -> np.ndarray:
    """[out, size] float32 weights of F.interpolate(mode="bilinear", align_corners=False) along one axis."""
    return _dense(_taps(int(size), int(out)), int(size))


def _along(x: np.ndarray, taps: Taps | None, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    if taps is None:
        if out is not None:
            out[...] = x
        return x if out is None else out
    index, weight = taps
    shape = (-1, 1) if axis == -2 else (-1,)
    out = np.take(x, index[:, 0], axis=axis, out=out)
    out *= weight[:, 0].reshape(shape)
    for j in range(1, index.shape[1]):
        other = np.take(x, index[:, j], axis=axis)
        other *= weight[:, j].reshape(shape)
        out += other
    return out


def _resize(x: np.ndarray, steps: Sequence[tuple[Taps | None, Taps | None]]) -> np.ndarray:
    """x [..., h, w] → float32 [..., H, W] through resizes in turn, each (row taps, column taps), columns first as
    torch does; a few maps at a time, so only the output is ever whole in memory."""
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1, *x.shape[-2:])
    sizes = [flat.shape[-2:]]
    for rows, cols in steps:
        sizes.append((sizes[-1][0] if rows is None else len(rows[0]), sizes[-1][1] if cols is None else len(cols[0])))
    out = np.empty((len(flat), *sizes[-1]), np.float32)
    step = max(1, _RESIZE_CHUNK // max(h * w for h, w in sizes))
    for i in range(0, len(flat), step):
        part = flat[i : i + step]
        for j, (rows, cols) in enumerate(steps):
            last = j == len(steps) - 1  # written straight into the output
            part = _along(_along(part, cols, -1), rows, -2, out[i : i + step] if last else None)
    return out.reshape(*x.shape[:-2], *out.shape[-2:])


def resize_bilinear(x: np.ndarray, out_hw: Sequence[int]) -> np.ndarray:
    """x [..., h, w] → float32 [..., H, W]: F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False)."""
    (h, w), (oh, ow) = x.shape[-2:], map(int, out_hw)
    return _resize(x, [(_taps(h, oh), _taps(w, ow))])


def sem_seg_postprocess(result: np.ndarray, img_size: Sequence[int], output_height: int,
                        output_width: int) -> np.ndarray:
    """detectron2's sem_seg_postprocess: [C, Hp, Wp] cropped to `img_size` (h, w), resized bilinearly to the output
    size."""
    h, w = map(int, img_size)
    return resize_bilinear(np.asarray(result)[..., :h, :w], (output_height, output_width))


def _nearest(ids: np.ndarray, crop_hw: Sequence[int], out_hw: Sequence[int]) -> np.ndarray:
    """[.., Hp, Wp] → cropped to `crop_hw`, resized to `out_hw` as F.interpolate(mode="nearest") picks pixels."""
    def index(size: int, out: int) -> np.ndarray:
        scale = np.float32(size) / np.float32(out)
        return np.minimum(np.floor(np.arange(out, dtype=np.float32) * scale).astype(np.int64), size - 1)

    (h, w), (oh, ow) = map(int, crop_hw), map(int, out_hw)
    return ids[..., index(h, oh)[:, None], index(w, ow)[None, :]]


# the three inferences -------------------------------------------------------------------------------------------------
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


def semantic_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, probs: np.ndarray | None = None) -> np.ndarray:
    """[Q, K+1] class logits, [Q, H, W] mask logits → [K, H, W] per-class scores (einsum "qc,qhw->chw" of the class
    probabilities without "no object" and the mask probabilities). `probs`: sigmoid(mask_pred), where known."""
    probs = sigmoid(mask_pred) if probs is None else probs
    q, h, w = probs.shape
    return (softmax(mask_cls)[:, :-1].T @ probs.reshape(q, h * w)).reshape(-1, h, w)


def _first_max(values) -> np.ndarray:
    """argmax over a sequence of equal-shaped arrays (the first on ties, as torch's argmax), as int32: a running
    maximum, 3x faster than ndarray.argmax(0) (which copies to make axis 0 the last) and never the stack in memory."""
    values = iter(values)
    best = np.array(next(values), np.float32)
    index = np.zeros(best.shape, np.int32)
    for i, v in enumerate(values, 1):
        better = v > best
        index[better] = i
        np.maximum(best, v, out=best)
    return index


class Upsampled:
    """A picture's mask logits [Q, H, W] as F.interpolate (bilinear, align_corners=False) makes them from the graph's
    [Q, h, w], made a band of rows at a time: the columns resized once, each band's rows from the few input rows it
    reads. `after`: (rows, cols) taps resizing the mask probabilities once more (semantic postprocessing after
    inference: the picture's corner of the padded size to the original), so `probs` bands are of that size."""

    def __init__(self, masks: np.ndarray, rows: Taps | None, cols: Taps | None,
                 after: tuple[Taps | None, Taps | None] = (None, None)):
        masks = np.asarray(masks, np.float32)
        if cols is None:
            self.columns = masks  # [Q, h, W]
        else:
            self.columns = np.empty((*masks.shape[:-1], len(cols[0])), np.float32)
            parts = np.array_split(np.arange(len(masks)), min(len(masks), 8))
            _each(lambda q: _along(masks[q[0] : q[-1] + 1], cols, -1, self.columns[q[0] : q[-1] + 1]), parts)
        self.rows, self.after = rows, after
        q, h, w = self.columns.shape
        self.logits_hw = (h if rows is None else len(rows[0]), w)
        arows, acols = after
        self.shape = (q, self.logits_hw[0] if arows is None else len(arows[0]),
                      w if acols is None else len(acols[0]))

    def logits(self, start: int, stop: int) -> np.ndarray:
        return _band(self.columns, self.rows, start, stop)

    def probs(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows [start, stop) of the probabilities, and of the logits where they are the same size (no `after`)."""
        rows, cols = self.after
        if rows is None and cols is None:
            logits = self.logits(start, stop)
            return sigmoid(logits), logits
        first, last = (start, stop) if rows is None else _reads(rows, start, stop)
        probs = _along(sigmoid(self.logits(first, last)), cols, -1)
        return _band(probs, rows, start, stop, first), None

    def whole(self) -> np.ndarray:
        return self.logits(0, self.logits_hw[0])

    def bands(self) -> list[tuple[int, int]]:
        q, h, w = self.shape
        step = max(1, _BAND // (q * w))
        return [(s, min(s + step, h)) for s in range(0, h, step)]


def _reads(rows: Taps, start: int, stop: int) -> tuple[int, int]:
    """The input rows [first, last) that output rows [start, stop) read."""
    index = rows[0][start:stop]
    return int(index.min()), int(index.max()) + 1


def _band(x: np.ndarray, rows: Taps | None, start: int, stop: int, offset: int | None = None) -> np.ndarray:
    """Output rows [start, stop) of resizing x [Q, h, W] along its rows; `offset`: x holds input rows from there on
    (the rows the band reads, see _reads), else all of them."""
    if rows is None:
        return x[:, start:stop] if offset is None else x
    index, weight = (t[start:stop] for t in rows)
    first = int(index.min()) if offset is None else offset
    part = x[:, first : int(index.max()) + 1] if offset is None else x
    return _along(part, (index - first, weight), -2)


def _masks_at(masks: np.ndarray, padded_hw: tuple[int, int], crop_hw: tuple[int, int] | None = None,
              out_hw: tuple[int, int] | None = None) -> np.ndarray:
    """Mask logits upsampled to the padded size, or (given `crop_hw` and `out_hw`) that cropped to `crop_hw` and
    resized to `out_hw` (sem_seg_postprocess) in one pass: the padded-size masks are never made."""
    (ph, pw), (mh, mw) = padded_hw, masks.shape[-2:]
    if crop_hw is None:
        return Upsampled(masks, _taps(mh, ph), _taps(mw, pw)).whole()
    (ch, cw), (oh, ow) = crop_hw, out_hw
    return Upsampled(masks, _then(mh, ph, ch, oh), _then(mw, pw, cw, ow)).whole()


_pool: tuple[int, ThreadPoolExecutor] | None = None
_blas: ThreadpoolController | None = None


def _one_blas_thread():
    """A scope in which BLAS runs on one thread (threadpoolctl; the loaded libraries are looked up once)."""
    global _blas
    _blas = _blas or ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


def _each(fn: Callable, items: list) -> list:
    """fn over items on a thread per core (numpy lets go of the GIL in its array loops); a pool per process, as one
    made before a fork does not run in the child."""
    global _pool
    if len(items) < 2:
        return [fn(x) for x in items]
    if _pool is None or _pool[0] != os.getpid():
        _pool = os.getpid(), ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="d2export-masks")
    return list(_pool[1].map(fn, items))


class _Competition:
    """Panoptic's per-pixel competition of the kept queries (`keep`, scored `scores`), a band at a time: the winner
    (first of the highest score × probability, as torch's argmax) and whether its own mask covers the pixel; per kept
    query its pixels won, its mask's pixels (probability >= 0.5) and the pixels it won and covers."""

    def __init__(self, keep: np.ndarray, scores: np.ndarray, hw: tuple[int, int]):
        self.keep, self.scores = keep, scores
        self.winner, self.inside = np.zeros(hw, np.int32), np.zeros(hw, bool)

    def band(self, start: int, stop: int, probs: np.ndarray, logits: np.ndarray) -> np.ndarray:
        masks = probs[self.keep]
        winner = self.winner[start:stop] = _first_max(score * mask for score, mask in zip(self.scores, masks))
        inside = self.inside[start:stop] = np.take_along_axis(masks, winner[None], 0)[0] >= 0.5
        k = len(self.keep)
        return np.stack([np.bincount(winner.ravel(), minlength=k),
                         np.count_nonzero((masks >= 0.5).reshape(k, -1), axis=1),
                         np.bincount(winner[inside], minlength=k)])


class _MaskScores:
    """Instance masks (logit > 0) of the picked queries and the sums of their mean probability over them, a band at a
    time. `alone`: the field holds the picked queries only (in `queries`' order), not every query."""

    def __init__(self, queries: np.ndarray, hw: tuple[int, int], alone: bool = False):
        self.queries = queries
        self.rows = slice(None) if alone else queries  # the picked queries' rows in the field
        self.positive = np.zeros((len(queries), *hw), bool)

    def band(self, start: int, stop: int, probs: np.ndarray, logits: np.ndarray) -> np.ndarray:
        n = len(self.queries)
        positive = self.positive[:, start:stop] = logits[self.rows] > 0
        inside = probs[self.rows].reshape(n, -1)
        inside *= positive.reshape(n, -1)
        return np.stack([inside.sum(1).astype(np.float64), np.count_nonzero(positive.reshape(n, -1), axis=1)])


class _SemanticMap:
    """semantic_inference's argmax (the first highest class, as torch's), a band at a time."""

    def __init__(self, classes: np.ndarray, hw: tuple[int, int]):
        self.classes = np.asarray(classes, np.float32) * _LIFTED  # [Q, K]: Rules.semantic
        self.map = np.zeros(hw, np.int32)

    def band(self, start: int, stop: int, probs: np.ndarray, logits: np.ndarray | None) -> None:
        q, rows, w = probs.shape
        lifted = probs.reshape(q, -1) * _LIFTED
        scores = lifted.T @ self.classes  # [pixels, K]: the argmax along contiguous memory
        self.map[start:stop] = scores.argmax(-1).reshape(rows, w)


def _per_pixel(field: Upsampled, *passes) -> list:
    """Runs each pass over every band of `field` (threads over bands); per pass, what its bands return summed (None
    for passes returning nothing). Bands depend on sizes only: results are the same on any number of cores."""
    def run(band):
        start, stop = band
        probs, logits = field.probs(start, stop)
        return [p.band(start, stop, probs, logits) for p in passes]

    with _one_blas_thread():  # each thread's BLAS on one core: two threads' products would fight for the cores
        parts = _each(run, field.bands())
    return [None if parts[0][i] is None else sum(part[i] for part in parts) for i in range(len(passes))]


def _segments(winner: np.ndarray, inside: np.ndarray, areas: np.ndarray, labels: np.ndarray,
              overlap_threshold: float, thing_ids: Sequence[int],
              class_names: Sequence[str]) -> tuple[np.ndarray, list[Segment]]:
    """panoptic_inference's walk over the kept queries in order, from the competition (per pixel the kept query
    winning it, and whether its mask covers it) and its areas [3, kept]: numbers the segments, drops those too
    covered, merges stuff of one class; the [H, W] int32 segment ids (0: none)."""
    mask_area, original_area, kept_area = areas
    things = {int(t) for t in thing_ids}
    segment_of = np.zeros(len(labels) + 1, np.int32)  # kept query → its segment id (0: dropped)
    segments: list[Segment] = []
    stuff: dict[int, int] = {}
    current = 0
    for i, label in enumerate(labels.tolist()):
        if not (mask_area[i] > 0 and original_area[i] > 0 and kept_area[i] > 0):
            continue
        if mask_area[i] / original_area[i] < overlap_threshold:
            continue
        isthing = label in things
        if not isthing:
            if label in stuff:  # merge stuff regions of one class
                segment_of[i] = stuff[label]
                continue
            stuff[label] = current + 1
        current += 1
        segment_of[i] = current
        segments.append(Segment(current, int(label), isthing,
                                class_names[label] if label < len(class_names) else None))
    panoptic = np.where(inside, segment_of[winner], 0).astype(np.int32)
    return panoptic, segments


def _instance_pairs(mask_cls: np.ndarray, num_classes: int, test_topk_per_image: int, panoptic_on: bool,
                    thing_ids: Sequence[int], rules: Rules):
    """instance_inference's top (query, class) pairs by class score, things only when panoptic is on."""
    flat = rules.instance(mask_cls).reshape(-1)  # [Q·K]: query-major, as upstream's flatten
    top = np.argsort(-flat, kind="stable")[: min(int(test_topk_per_image), flat.size)]  # ties: the lower index
    queries, labels, class_scores = top // num_classes, top % num_classes, flat[top]
    kept = _kept_pairs(labels, class_scores, panoptic_on, thing_ids, rules)
    return queries[kept], labels[kept], class_scores[kept]


def _kept_pairs(labels: np.ndarray, class_scores: np.ndarray, panoptic_on: bool, thing_ids: Sequence[int],
                rules: Rules) -> np.ndarray:
    """Which top-k pairs upstream keeps after its top-k: those scoring over OneFormer's demo threshold, things only
    when panoptic is on."""
    kept = np.ones(len(labels), bool) if rules.min_class_score is None else class_scores > rules.min_class_score
    return kept & np.isin(labels, np.asarray(list(thing_ids), np.int64)) if panoptic_on else kept


def _instances(pairs, masks: _MaskScores, sums: np.ndarray | None, class_names: Sequence[str],
               to_original: Callable[[np.ndarray], np.ndarray] | None, threshold: float | None,
               rules: Rules = Rules(), boxes: np.ndarray | None = None) -> list[Instance]:
    """The pairs scored (class score × their query's mean mask probability, or the class score alone where
    `focus_on_box`), then listed."""
    queries, labels, class_scores = pairs
    row = {int(j): i for i, j in enumerate(masks.queries)}
    picked = np.asarray([row[int(j)] for j in queries], np.int64)
    mean = np.zeros(0, np.float32) if sums is None else (
        sums[0].astype(np.float32) / (sums[1].astype(np.float32) + np.float32(1e-6)))
    scores = class_scores if rules.focus_on_box or not len(picked) else class_scores * mean[picked]
    return _listed(queries, labels, scores, lambda j: masks.positive[row[j]], class_names, to_original, threshold,
                   rules, boxes)


def _listed(queries: np.ndarray, labels: np.ndarray, scores: np.ndarray, mask_of: Callable[[int], np.ndarray],
            class_names: Sequence[str], to_original: Callable[[np.ndarray], np.ndarray] | None,
            threshold: float | None, rules: Rules, boxes: np.ndarray | None) -> list[Instance]:
    """Scored (query, class) pairs as Instances sorted by score, descending; each query's mask (`mask_of`, mapped by
    `to_original`) encoded once; `boxes` [Q, 4] x0 y0 x1 y1 per query where the model has them (else from the masks
    where the rules say, else none)."""
    order = np.argsort(-scores, kind="stable")
    if threshold is not None:
        order = order[scores[order].astype(np.float64) >= threshold]  # as the float scores compare
    encoded: dict[int, tuple] = {}
    found = []
    for i in order.tolist():
        j, label = int(queries[i]), int(labels[i])
        if j not in encoded:
            positive = mask_of(j)
            positive = to_original(positive) if to_original else positive
            encoded[j] = encode_mask(positive), _mask_box(positive) if rules.boxes_from_masks else None
        mask, box = encoded[j]
        found.append(Instance(score=float(scores[i]), label=_label(label, rules.label_ids),
                              class_name=class_names[label] if label < len(class_names) else None,
                              mask=mask, box=box if boxes is None else boxes[j].tolist()))
    return found


def _label(label: int, ids: Sequence[int]) -> int:
    """OneFormer's ADE20K instance label: the class's place among the thing classes' dataset ids (upstream's
    `thing_indices.index`), where it has one."""
    return ids.index(label) if label in ids else label


def _mask_box(mask: np.ndarray) -> list[float]:
    """detectron2's BitMasks.get_bounding_boxes of one mask: x0 y0 x1 y1, the far edges one past the last pixel;
    zeros for an empty mask."""
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if not len(rows):
        return [0.0, 0.0, 0.0, 0.0]
    return [float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)]


def panoptic_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, num_classes: int, object_mask_threshold: float,
                       overlap_threshold: float, thing_ids: Sequence[int],
                       class_names: Sequence[str] = (),
                       rules: Rules = Rules()) -> tuple[np.ndarray, list[Segment]]:
    """Mask2Former's panoptic_inference on [Q, K+1] class and [Q, H, W] mask logits (MaskDINO's with its
    `rules`): [H, W] int32 segment ids (0: none) and the segments, in upstream's order."""
    keep, labels, scores = rules.panoptic(mask_cls, num_classes, object_mask_threshold)
    competition = _Competition(keep, scores, mask_pred.shape[-2:])
    if len(keep) == 0:
        return competition.winner, []
    (areas,) = _per_pixel(Upsampled(mask_pred, None, None), competition)
    return _segments(competition.winner, competition.inside, areas, labels, overlap_threshold, thing_ids,
                     class_names)


def instance_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, num_classes: int, test_topk_per_image: int,
                       panoptic_on: bool, thing_ids: Sequence[int], class_names: Sequence[str] = (),
                       to_original: Callable[[np.ndarray], np.ndarray] | None = None,
                       threshold: float | None = None, rules: Rules = Rules()) -> list[Instance]:
    """Mask2Former's instance_inference (MaskDINO's and OneFormer's, boxes aside, with their `rules`): the top
    `test_topk_per_image` (query, class) pairs by class probability (things only when `panoptic_on`), each with its
    query's mask (logit > 0, COCO RLE) and score = probability × the mask's mean probability over its pixels.
    Upstream's topk is unsorted; these are sorted by score, descending (ties: the higher class probability first, then
    the lower query and class). Boxes stay None (upstream's are zeros). `to_original`: maps a mask to the original
    picture's pixels before it is encoded; `threshold`: pairs scoring below it are left out (before their masks are
    encoded)."""
    pairs = _instance_pairs(mask_cls, num_classes, test_topk_per_image, panoptic_on, thing_ids, rules)
    masks = _MaskScores(np.unique(pairs[0]), mask_pred.shape[-2:], alone=True)
    (sums,) = _per_pixel(Upsampled(mask_pred[masks.queries], None, None), masks) if len(masks.queries) else (None,)
    return _instances(pairs, masks, sums, class_names, to_original, threshold, rules)


def _boxes(boxes: np.ndarray, scale_hw: tuple[float, float]) -> np.ndarray:
    """MaskDINO's box_postprocess: [Q, 4] cx cy w h relative to the padded batch → x0 y0 x1 y1 in the original
    picture's pixels, the padded size scaled as the picture is (`scale_hw`: the padded size in original pixels)."""
    cx, cy, w, h = np.asarray(boxes, np.float32).T
    xyxy = np.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], -1)
    sh, sw = (np.float32(v) for v in scale_hw)
    return xyxy * np.array([sw, sh, sw, sh], np.float32)


# one picture ----------------------------------------------------------------------------------------------------------
def mask_prediction(outputs: dict[str, np.ndarray], index: int, input_hw: Sequence[int], original_hw: Sequence[int],
                    post: dict[str, Any], threshold: float = 0.0) -> Prediction:
    """Row `index` of a batch's `pred_logits` and `pred_masks` (and MaskDINO's `pred_boxes`) → the picture's
    prediction, as MaskFormer.forward (MaskDINO.forward) makes it (see the module's docstring for `post`):
    `semantic`, `panoptic` and `segments`, `instances` as `post` turns them on. `input_hw`: the picture's size in
    the graph (unpadded), `original_hw` its size before resizing.
    Instances scoring below `threshold` are left out (upstream keeps them all: threshold 0)."""
    mask_cls = np.asarray(outputs["pred_logits"][index], np.float32)
    masks = np.asarray(outputs["pred_masks"][index], np.float32)
    (h, w), (oh, ow) = tuple(map(int, input_hw)), tuple(map(int, original_hw))
    padded = (masks.shape[-2] * MASK_STRIDE, masks.shape[-1] * MASK_STRIDE)
    if h > padded[0] or w > padded[1]:
        raise ValueError(f"picture of {h}x{w} in the graph, but its masks cover {padded[0]}x{padded[1]}")
    def value(key: str):
        if key not in post:  # no default guessed: upstream's config defaults differ from its published models'
            raise ValueError(f"the manifest's postprocess has no {key!r} (see d2export/families/_masks.py)")
        return post[key]

    num_classes, rules = int(value("num_classes")), Rules.of(post)
    if mask_cls.shape[-1] != num_classes + rules.extra:
        raise ValueError(f"pred_logits has {mask_cls.shape[-1]} classes; the manifest says {num_classes}"
                         + " + 1" * rules.extra)
    before = bool(value("sem_seg_postprocess_before_inference"))
    semantic_on, panoptic_on, instance_on = (bool(value(k)) for k in ("semantic_on", "panoptic_on", "instance_on"))
    thing_ids = list(value("thing_ids")) if panoptic_on else []
    names = list(post.get("class_names") or [])
    prediction = Prediction(oh, ow)
    (mh, mw), (ph, pw) = masks.shape[-2:], padded
    pairs = _instance_pairs(mask_cls, num_classes, int(value("test_topk_per_image")), panoptic_on, thing_ids,
                            rules) if instance_on else None
    picked = np.unique(pairs[0]) if instance_on else None
    # instances alone read their picked queries' masks only: the others are never upsampled
    alone = instance_on and len(picked) > 0 and not panoptic_on and not (semantic_on and before)
    field_masks = masks[picked] if alone else masks
    if before:  # the masks cropped and resized to the original picture, then every inference there
        field = Upsampled(field_masks, _then(mh, ph, h, oh), _then(mw, pw, w, ow))
        semantic_field, back = field, None
    else:  # panoptic and instance read the padded masks, as upstream; semantic the picture's corner, resized after
        field = Upsampled(field_masks, _taps(mh, ph), _taps(mw, pw)) if panoptic_on or instance_on else None
        semantic_field = Upsampled(masks, _taps(mh, ph, h), _taps(mw, pw, w), after=(_taps(h, oh), _taps(w, ow)))
        back = functools.partial(_nearest, crop_hw=(h, w), out_hw=(oh, ow))
    passes, semantic, competition, instances = [], None, None, None
    if semantic_on:
        semantic = _SemanticMap(rules.semantic(mask_cls), semantic_field.shape[1:])
        if semantic_field is not field:
            _per_pixel(semantic_field, semantic)
        else:
            passes.append(semantic)
    if panoptic_on:
        keep, labels, scores = rules.panoptic(mask_cls, num_classes, float(value("object_mask_threshold")))
        competition = _Competition(keep, scores, field.shape[1:])
        if len(keep):
            passes.append(competition)
    if instance_on:
        instances = _MaskScores(picked, field.shape[1:], alone)
        if len(instances.queries):
            passes.append(instances)
    sums = dict(zip(map(id, passes), _per_pixel(field, *passes))) if passes else {}  # one pass over the pixels
    if semantic is not None:
        prediction.semantic = semantic.map
    if competition is not None:
        panoptic, segments = (_segments(competition.winner, competition.inside, sums[id(competition)], labels,
                                        float(value("overlap_threshold")), thing_ids, names)
                              if len(keep) else (competition.winner, []))
        prediction.panoptic, prediction.segments = (panoptic if back is None else back(panoptic)), segments
    if instances is not None:
        boxes = _boxes(outputs["pred_boxes"][index], (ph / h * oh, pw / w * ow)) if rules.sigmoid else None
        prediction.instances = _instances(pairs, instances, sums.get(id(instances)), names, back, threshold,
                                          rules, boxes)
    return prediction


def graph_prediction(outputs: dict[str, np.ndarray], index: int, input_hw: Sequence[int],
                     original_hw: Sequence[int], post: dict[str, Any], threshold: float = 0.0) -> Prediction:
    """mask_prediction's results from a graph exported with export.postprocess=graph (d2export/tracing/
    mask_results.py): the picture's corner of the in-graph maps and masks, the panoptic walk over its kept queries,
    the instance pairs listed; where the original picture's size differs from the graph's, maps and masks are
    resized to it by nearest pixels (the default graph's serving resizes mask logits before inference instead)."""
    (h, w), (oh, ow) = tuple(map(int, input_hw)), tuple(map(int, original_hw))
    rules, prediction = Rules.of(post), Prediction(oh, ow)
    names, panoptic_on = list(post.get("class_names") or []), bool(post["panoptic_on"])
    thing_ids = list(post["thing_ids"]) if panoptic_on else []
    back = (lambda m: m[..., :h, :w]) if (h, w) == (oh, ow) else functools.partial(
        _nearest, crop_hw=(h, w), out_hw=(oh, ow))
    if post["semantic_on"]:
        prediction.semantic = back(np.asarray(outputs["sem_seg"][index])).astype(np.int32)
    if panoptic_on:
        kept = np.flatnonzero(outputs["query_keep"][index])
        place = np.zeros(len(outputs["query_keep"][index]) + 1, np.int64)  # query → its place among the kept
        place[kept] = np.arange(len(kept))
        query = back(np.asarray(outputs["panoptic_query"][index]))
        panoptic, segments = _segments(place[query], query >= 0, outputs["query_areas"][index][kept].T,
                                       outputs["query_labels"][index][kept], float(post["overlap_threshold"]),
                                       thing_ids, names)
        prediction.panoptic, prediction.segments = panoptic, segments
    if post["instance_on"]:
        queries, labels, scores = (np.asarray(outputs[k][index]) for k in
                                   ("instance_queries", "instance_labels", "instance_scores"))
        if rules.min_class_score is not None or panoptic_on:  # upstream's filters after its top-k
            classes = rules.instance(np.asarray(outputs["pred_logits"][index], np.float32))[queries, labels]
            keep = _kept_pairs(labels, classes, panoptic_on, thing_ids, rules)
            queries, labels, scores = queries[keep], labels[keep], scores[keep]
        masks = outputs["instance_masks"][index]
        (ph, pw) = masks.shape[-2:]
        boxes = _boxes(outputs["pred_boxes"][index], (ph / h * oh, pw / w * ow)) if rules.sigmoid else None
        prediction.instances = _listed(queries, labels, scores.astype(np.float32), lambda j: masks[j], names, back,
                                       threshold, rules, boxes)
    return prediction

