"""What a segmenter serves, held to the model's own inference: per verification case, the results serving makes of
the eager reference's outputs (the family's `prediction`, as the runtime calls it with the manifest's postprocess
section: families/_mask_predictions.py `mask_prediction` on the head's `pred_logits` and `pred_masks` by default,
`graph_prediction` on the in-graph results with `export.postprocess=graph`) against what the model's own
`semantic_inference`, `panoptic_inference` and `instance_inference` returned inside the same forward (the adapter's
`own_results`). The graph is compared with the reference tensor by tensor; this check is what keeps d2export's
serving rules (the numpy ones and, in the graph, tracing/mask_results.py) the model's own: a wrong threshold,
"no object" column or score rule refuses the export. Done once per verification case, before any near-tie pinning
(a pinned rerun imposes the graph's ties, already judged float noise). A model without those methods is said so in
the record (`own_inference`), never checked silently.
"""
from __future__ import annotations

import logging

import numpy as np

from d2export.instances import decode_mask, mask_iou
from d2export.verification.comparison import VerificationError

log = logging.getLogger("d2export")

# each task's own inference method on the model and the key of its result in the forward's output
OWN_METHODS = {"semantic_on": ("semantic_inference", "sem_seg"),
               "panoptic_on": ("panoptic_inference", "panoptic_seg"),
               "instance_on": ("instance_inference", "instances")}
# what serving must agree with the model's own inference on: float ties aside (the two sum in other orders), a
# semantic map's pixels, each panoptic segment's pixels (IoU), each instance's mask (IoU) and score
SEMANTIC_AGREEMENT = 0.999
SEMANTIC_TIE = 1e-5  # relative: float32 sums of a few hundred queries' products in another order differ by ~1e-6
SEGMENT_IOU = 0.99
MASK_IOU = 0.99
SCORE_ATOL = 1e-4


def start(built) -> dict | None:
    """The verification record of a mask-classification model's served results (None for other adapters), kept on
    its adapter as `own_inference` for the manifest."""
    post = served_post(built)
    if post is None:
        return None
    built.adapter.own_inference = own_methods(built.adapter.model, post) | {
        "postprocess": "graph" if post.get("in_graph") else "served"}
    return built.adapter.own_inference


def served_post(built) -> dict | None:
    """The postprocess section serving reads (the manifest's, `in_graph` where export.postprocess=graph), or None
    where the adapter is no MaskFormer-style one (nothing of the kind to hold)."""
    if not hasattr(built.adapter, "own_results"):
        return None
    post = built.family.postprocess(built.d2cfg)
    if "semantic_on" not in post:
        return None
    return post | ({"in_graph": True} if getattr(built.adapter, "post", None) else {})


def hold(built, expected: list, images, record: dict) -> None:
    """One case: the reference's outputs (`expected`, in the adapter's output order) served as the runtime serves
    them (the family's `prediction`), against the model's own results of that reference call."""
    adapter = built.adapter
    if record["checked"]:
        held_to_own_inference(dict(zip(adapter.output_names, expected)), adapter.own_results,
                              [im.shape[-2:] for im in images], served_post(built), record,
                              built.family.prediction)


def own_methods(model, post: dict) -> dict:
    """The verification record of the served results' check against the model's own inference: which methods it
    calls, or why there is no check (the model lacks them)."""
    wanted = [method for task, (method, _) in OWN_METHODS.items() if post[task]]
    missing = [m for m in wanted if not callable(getattr(model, m, None))]
    if missing:
        why = (f"{type(model).__name__} has no {', '.join(missing)}: its served results are verified against "
               "d2export's rules only, not the model's own inference")
        log.warning("%s", why)
        return {"checked": False, "methods": wanted, "missing": missing, "why": why}
    return {"checked": True, "methods": wanted, "cases": {}}


def held_to_own_inference(outputs: dict[str, np.ndarray], own: list[dict], sizes, post: dict, record: dict,
                          predict) -> None:
    """What serving makes of the reference's outputs (`predict`: the family's `prediction`, at each picture's own
    size) against the model's own inference results of the same forward (`own`, list[dict] as MaskFormer.forward
    returns them at the pictures' sizes); the figures go to `record["cases"]`, and a disagreement past the float
    ties refuses."""
    case = "+".join(f"{int(h)}x{int(w)}" for h, w in sizes)
    figures, wrong = {}, []
    for i, (hw, theirs) in enumerate(zip(sizes, own)):
        hw = tuple(map(int, hw))
        served = predict(outputs, i, hw, hw, post, 0.0)  # every instance, as upstream keeps them all
        seen, why = agreement(served, theirs, post)
        for key, value in seen.items():  # counts summed over the batch, the other figures its worst
            if key not in figures:
                figures[key] = value
            elif isinstance(value, list):
                figures[key] = [a + b for a, b in zip(figures[key], value)]
            else:
                worst = min if key in ("semantic_pixels", "segment_iou", "mask_iou") else max  # semantic_tied: the most
                figures[key] = worst(figures[key], value)
        wrong += why
    record["cases"][case] = figures
    if wrong:
        how = "the in-graph post-processing" if post.get("in_graph") else "the head's outputs (served rules)"
        raise VerificationError(
            f"served results at {case}: the results served from {how} differ from "
            f"the model's own {', '.join(record['methods'])}: {'; '.join(wrong)}")


def agreement(served, theirs: dict, post: dict) -> tuple[dict, list[str]]:
    """A served Prediction against one picture's result of the model's own forward: (figures, what is wrong)."""
    figures, wrong = {}, []
    if post["semantic_on"]:
        scores = theirs["sem_seg"].float().cpu().numpy()  # [K, H, W]
        best = scores.max(0)
        same = served.semantic == scores.argmax(0)
        # a class the model's own scores give its best to float rounding is as right (saturated sigmoids make exact
        # ties: MaskDINO's seeded heads tie classes at 1.0, its sums then differ in their last bits only)
        mine = np.take_along_axis(scores, served.semantic[None].astype(np.int64), 0)[0]
        tied = ~same & (mine >= best - SEMANTIC_TIE * np.abs(best))
        figures["semantic_pixels"], figures["semantic_tied"] = float(same.mean()), float(tied.mean())
        if figures["semantic_pixels"] + figures["semantic_tied"] < SEMANTIC_AGREEMENT:
            wrong.append(f"the semantic map agrees on {figures['semantic_pixels']:.4%} of pixels, "
                         f"{figures['semantic_tied']:.4%} more on classes tied with the model's best "
                         f"(needs {SEMANTIC_AGREEMENT:.1%})")
    if post["panoptic_on"]:
        ids, segments = theirs["panoptic_seg"]
        ids = ids.cpu().numpy()
        mine = [(s.category_id, bool(s.isthing)) for s in served.segments]
        figures["segments"] = [len(served.segments), len(segments)]
        if mine != [(int(s["category_id"]), bool(s["isthing"])) for s in segments]:
            theirs_ = [(s["category_id"], s["isthing"]) for s in segments]
            wrong.append(f"segments (class, thing) {mine} served, {theirs_} the model's")
        else:
            ious = [mask_iou(served.panoptic == a.id, ids == b["id"]) for a, b in zip(served.segments, segments)]
            figures["segment_iou"] = min(ious, default=1.0)
            if figures["segment_iou"] < SEGMENT_IOU:
                wrong.append(f"a segment's pixels overlap the model's by IoU {figures['segment_iou']:.4f} "
                             f"(needs {SEGMENT_IOU})")
    if post["instance_on"]:
        inst = theirs["instances"]
        own = list(zip(inst.pred_classes.tolist(), inst.scores.tolist(), inst.pred_masks.bool().cpu().numpy()))
        figures["instances"] = [len(served.instances), len(own)]
        score, iou, unmatched = 0.0, 1.0, 0
        for found in served.instances:
            mask = decode_mask(found.mask)
            candidates = [j for j, (label, _, _) in enumerate(own) if label == found.label]
            if not candidates:
                unmatched += 1
                continue
            # upstream's top-k is unsorted: each served instance against the closest of the model's of its class
            j = min(candidates, key=lambda c: (-mask_iou(mask, own[c][2]), abs(own[c][1] - found.score)))
            score, iou = max(score, abs(own[j][1] - found.score)), min(iou, mask_iou(mask, own[j][2]))
            own.pop(j)
        figures |= {"score_diff": score, "mask_iou": iou}
        if unmatched or own:
            wrong.append(f"{len(served.instances)} instances served, {figures['instances'][1]} the model's "
                         f"({unmatched + len(own)} without a counterpart of their class)")
        if score > SCORE_ATOL or iou < MASK_IOU:
            wrong.append(f"instance scores up to {score:.3g} off (within {SCORE_ATOL}), masks IoU down to {iou:.4f} "
                         f"(needs {MASK_IOU})")
    return figures, wrong
