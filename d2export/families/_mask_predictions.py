"""Serving-side post-processing of mask-classification models (Mask2Former, MaskFormer), numpy only: a picture's
semantic, panoptic and instance results from the graph's outputs as the model's own `forward` makes them at inference,
so a served model answers as the PyTorch model does (to float32 rounding); `graph_prediction` for postprocess=graph.

Per picture, from `pred_logits` [Q, K+1] (the last class is "no object") and `pred_masks` [Q, Hp/4, Wp/4] mask
logits over the batch's padded size (Hp, Wp):
  1. the masks upsampled bilinearly (align_corners=False) to (Hp, Wp); with `sem_seg_postprocess_before_inference`,
     cropped to the picture's size in the graph (h, w) and resized to the original (H, W) (`sem_seg_postprocess`);
  2. `semantic_inference`: per-class scores softmax(classes)[:, :-1] · sigmoid(masks) → [K, ·, ·] (postprocessed to
     (H, W) afterwards where step 1 did not: the argmax made at (h, w), only class borders' scores resized, see
     `semantic_resized`); `Prediction.semantic` is their argmax;
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

import functools
from typing import Any, Callable, Sequence

import numpy as np

from d2export.families._mask_passes import (Upsampled, _Competition, _MaskScores, _per_pixel, _SemanticMap,
                                            semantic_resized)
from d2export.families._mask_resize import _nearest, _taps, _then
from d2export.families._mask_rules import Rules, sigmoid, softmax
from d2export.instances import Instance, Prediction, Segment, encode_mask

MASK_STRIDE = 4  # pred_masks is over the padded batch at 1/4 of its size (the pixel decoder's finest level)


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


def semantic_inference(mask_cls: np.ndarray, mask_pred: np.ndarray, probs: np.ndarray | None = None) -> np.ndarray:
    """[Q, K+1] class logits, [Q, H, W] mask logits → [K, H, W] per-class scores (einsum "qc,qhw->chw" of the class
    probabilities without "no object" and the mask probabilities). `probs`: sigmoid(mask_pred), where known."""
    probs = sigmoid(mask_pred) if probs is None else probs
    q, h, w = probs.shape
    return (softmax(mask_cls)[:, :-1].T @ probs.reshape(q, h * w)).reshape(-1, h, w)


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
            raise ValueError(f"the manifest's postprocess has no {key!r} (see d2export/families/_mask_predictions.py)")
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
    passes, semantic, competition, instances = [], None, None, None
    if before:  # the masks cropped and resized to the original picture, then every inference there
        field, back = Upsampled(field_masks, _then(mh, ph, h, oh), _then(mw, pw, w, ow)), None
        if semantic_on:
            semantic = _SemanticMap(rules.semantic(mask_cls), field.shape[1:])
            passes.append(semantic)
    else:  # panoptic and instance read the padded masks, as upstream; semantic the picture's corner, resized after
        field = Upsampled(field_masks, _taps(mh, ph), _taps(mw, pw)) if panoptic_on or instance_on else None
        back = functools.partial(_nearest, crop_hw=(h, w), out_hw=(oh, ow))
        if semantic_on:
            prediction.semantic = semantic_resized(Upsampled(masks, _taps(mh, ph, h), _taps(mw, pw, w)),
                                                   rules.semantic(mask_cls), _taps(h, oh), _taps(w, ow))
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
