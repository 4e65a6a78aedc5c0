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
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np

from d2export.instances import Instance, Prediction, Segment, encode_mask

MASK_STRIDE = 4  # pred_masks is over the padded batch at 1/4 of its size (the pixel decoder's finest level)
_RESIZE_CHUNK = 1 << 20  # float32 elements a resize step holds per map group: small enough to stay in cache
_CHUNK = 1 << 24  # float32 elements of per-class scores held at once while the semantic argmax is taken


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


def _masks_at(masks: np.ndarray, padded_hw: tuple[int, int], crop_hw: tuple[int, int] | None = None,
              out_hw: tuple[int, int] | None = None) -> np.ndarray:
    """Mask logits upsampled to the padded size, or (given `crop_hw` and `out_hw`) that cropped to `crop_hw` and
    resized to `out_hw` (sem_seg_postprocess) in one pass: the padded-size masks are never made."""
    (ph, pw), (mh, mw) = padded_hw, masks.shape[-2:]
    if crop_hw is None:
        return _resize(masks, [(_taps(mh, ph), _taps(mw, pw))])
    (ch, cw), (oh, ow) = crop_hw, out_hw
    return _resize(masks, [(_then(mh, ph, ch, oh), _then(mw, pw, cw, ow))])


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


def _semantic_map(mask_cls: np.ndarray, probs: np.ndarray, crop_hw: tuple[int, int] | None = None,
                  out_hw: tuple[int, int] | None = None) -> np.ndarray:
    """The argmax of semantic_inference (postprocessed to `out_hw` from the `crop_hw` corner, where given) as [H, W]
    int32, a band of rows at a time: the [K, H, W] scores are never all in memory."""
    classes = softmax(mask_cls)[:, :-1].T  # [K, Q]
    k, q = classes.shape
    if crop_hw is None:
        h, w = probs.shape[-2:]
        out = np.empty((h, w), np.int32)
        step = max(1, _CHUNK // (k * w))
        for s in range(0, h, step):
            out[s : s + step] = _first_max(classes @ probs[:, s : s + step].reshape(q, -1)).reshape(-1, w)
        return out
    (ch, cw), (oh, ow) = crop_hw, out_hw
    rows, cols = _taps(ch, oh), _taps(cw, ow)
    out = np.empty((oh, ow), np.int32)
    step = max(1, _CHUNK // (k * max(ch, ow)))  # output rows at a time
    for s in range(0, oh, step):
        if rows is None:
            first, last, band = s, min(s + step, oh) - 1, None
        else:
            index, weight = (t[s : s + step] for t in rows)
            first, last = int(index.min()), int(index.max())  # the input rows the band reads
            band = (index - first, weight)
        region = probs[:, first : last + 1, :cw]
        scores = (classes @ region.reshape(q, -1)).reshape(k, last + 1 - first, cw)  # semantic_inference's rows
        out[s : s + step] = _first_max(_resize(scores, [(band, cols)]))
    return out


def panoptic_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, num_classes: int, object_mask_threshold: float,
                       overlap_threshold: float, thing_ids: Sequence[int], class_names: Sequence[str] = (),
                       probs: np.ndarray | None = None) -> tuple[np.ndarray, list[Segment]]:
    """Mask2Former's panoptic_inference: [H, W] int32 segment ids (0: none) and the segments, in upstream's order.
    The per-pixel competition, areas and overlaps are whole-array operations; only the walk over kept queries, which
    numbers the segments and merges stuff, is a loop (over scalars)."""
    probs = sigmoid(mask_pred) if probs is None else probs
    scores_all = softmax(mask_cls)
    labels, scores = scores_all.argmax(-1), scores_all.max(-1)
    keep = np.flatnonzero((labels != num_classes) & (scores > object_mask_threshold))
    h, w = probs.shape[-2:]
    panoptic = np.zeros((h, w), np.int32)
    segments: list[Segment] = []
    if len(keep) == 0:
        return panoptic, segments
    masks = probs[keep]  # [k, H, W]
    winner = _first_max(score * mask for score, mask in zip(scores[keep], masks))
    inside = np.take_along_axis(masks, winner[None], 0)[0] >= 0.5  # the winner's own mask covers the pixel
    mask_area = np.bincount(winner.ravel(), minlength=len(keep))
    original_area = np.count_nonzero((masks >= 0.5).reshape(len(keep), -1), axis=1)
    kept_area = np.bincount(winner[inside], minlength=len(keep))
    things = {int(t) for t in thing_ids}
    segment_of = np.zeros(len(keep) + 1, np.int32)  # kept query → its segment id (0: dropped)
    stuff: dict[int, int] = {}
    current = 0
    for i, label in enumerate(labels[keep].tolist()):
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
    panoptic[inside] = segment_of[winner[inside]]
    return panoptic, segments


def instance_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, num_classes: int, test_topk_per_image: int,
                       panoptic_on: bool, thing_ids: Sequence[int], class_names: Sequence[str] = (),
                       probs: np.ndarray | None = None,
                       to_original: Callable[[np.ndarray], np.ndarray] | None = None,
                       threshold: float | None = None) -> list[Instance]:
    """Mask2Former's instance_inference: the top `test_topk_per_image` (query, class) pairs by class probability
    (things only when `panoptic_on`), each with its query's mask (logit > 0, COCO RLE) and score = probability × the
    mask's mean probability over its pixels. Upstream's topk is unsorted; these are sorted by score, descending
    (ties: the higher class probability first, then the lower query and class). Boxes stay None (upstream's are
    zeros). `to_original`: maps a mask to the original picture's pixels before it is encoded; `threshold`: pairs
    scoring below it are left out (before their masks are encoded)."""
    q = mask_cls.shape[0]
    flat = softmax(mask_cls)[:, :-1].reshape(-1)  # [Q·K]: query-major, as upstream's flatten
    top = np.argsort(-flat, kind="stable")[: min(int(test_topk_per_image), flat.size)]  # ties: the lower index
    queries, labels, class_scores = top // num_classes, top % num_classes, flat[top]
    if panoptic_on:
        thing = np.isin(labels, np.asarray(list(thing_ids), np.int64))
        queries, labels, class_scores = queries[thing], labels[thing], class_scores[thing]
    mask_score = np.zeros(q, np.float32)
    for j in np.unique(queries):  # one per query however many classes it was picked with
        positive = mask_pred[j] > 0
        p = (sigmoid(mask_pred[j]) if probs is None else probs[j])
        mask_score[j] = np.float32((p * positive).sum()) / np.float32(positive.sum() + 1e-6)
    scores = class_scores * mask_score[queries]
    order = np.argsort(-scores, kind="stable")
    if threshold is not None:
        order = order[scores[order].astype(np.float64) >= threshold]  # as the float scores compare
    encoded: dict[int, dict[str, Any]] = {}
    found = []
    for i in order.tolist():
        j, label = int(queries[i]), int(labels[i])
        if j not in encoded:
            positive = mask_pred[j] > 0
            encoded[j] = encode_mask(to_original(positive) if to_original else positive)
        found.append(Instance(score=float(scores[i]), label=label,
                              class_name=class_names[label] if label < len(class_names) else None,
                              mask=encoded[j]))
    return found


# one picture ----------------------------------------------------------------------------------------------------------
def mask_prediction(outputs: dict[str, np.ndarray], index: int, input_hw: Sequence[int], original_hw: Sequence[int],
                    post: dict[str, Any], threshold: float = 0.0) -> Prediction:
    """Row `index` of a batch's `pred_logits` and `pred_masks` → the picture's prediction, as MaskFormer.forward
    makes it (see the module's docstring for `post`): `semantic`, `panoptic` and `segments`, `instances` as `post`
    turns them on. `input_hw`: the picture's size in the graph (unpadded), `original_hw` its size before resizing.
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

    num_classes = int(value("num_classes"))
    if mask_cls.shape[-1] != num_classes + 1:
        raise ValueError(f"pred_logits has {mask_cls.shape[-1]} classes; the manifest says {num_classes} + 1")
    before = bool(value("sem_seg_postprocess_before_inference"))
    semantic_on, panoptic_on, instance_on = (bool(value(k)) for k in ("semantic_on", "panoptic_on", "instance_on"))
    thing_ids = list(value("thing_ids")) if panoptic_on else []
    names = list(post.get("class_names") or [])
    prediction = Prediction(oh, ow)
    if before:
        mask_pred = _masks_at(masks, padded, (h, w), (oh, ow))
        back = None
    else:  # panoptic and instance read the padded masks, as upstream; semantic only the picture's corner
        mask_pred = _masks_at(masks, padded) if panoptic_on or instance_on else _masks_at(masks, padded, (h, w), (h, w))
        back = functools.partial(_nearest, crop_hw=(h, w), out_hw=(oh, ow))
    del masks
    probs = sigmoid(mask_pred)
    if semantic_on:
        prediction.semantic = (_semantic_map(mask_cls, probs) if before
                               else _semantic_map(mask_cls, probs, (h, w), (oh, ow)))
    if panoptic_on:
        panoptic, segments = panoptic_inference(mask_cls, mask_pred, num_classes,
                                                float(value("object_mask_threshold")),
                                                float(value("overlap_threshold")), thing_ids, names, probs)
        prediction.panoptic, prediction.segments = (panoptic if back is None else back(panoptic)), segments
    if instance_on:
        prediction.instances = instance_inference(mask_cls, mask_pred, num_classes, int(value("test_topk_per_image")),
                                                  panoptic_on, thing_ids, names, probs, back, threshold)
    return prediction
