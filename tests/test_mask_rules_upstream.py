"""Mask2Former's post-processing rules held to upstream (tests/mask2former_upstream.py: an independent numpy
transcription of MaskFormer's forward and its three inference functions), both ways d2export serves them:
- the default graph's results made by numpy at serving (d2export/families/_mask_predictions.py `mask_prediction`);
- export.postprocess=graph's, computed in torch as the graph does (d2export/tracing/mask_results.py), served by
  `graph_prediction`.
Each rule is shown to matter: altered one at a time (the object-mask threshold, the overlap threshold, the "no
object" column, score = class probability × mask score), the comparison refuses it on the same head outputs; and an
export's eager reference (the tiny Mask2Former, export.postprocess=graph) refuses it against the model's own
inference functions.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mask2former_upstream as upstream
from d2export.families import _mask_predictions, _mask_rules
from d2export.instances import decode_mask
from d2export.tracing import mask_results

SEEDS = (0, 1, 2, 3)
SIZES = [(96, 128), (83, 117)]  # one batch padded to 96x128 (masks 24x32); the second picture leaves padding
SEMANTIC, IOU, SCORE = 0.999, 0.99, 1e-4  # the goals' agreement: float ties aside


def _iou(a, b) -> float:
    union = np.count_nonzero(a | b)
    return 1.0 if not union else np.count_nonzero(a & b) / union


def figures(prediction, ref: dict) -> dict:
    """How a served prediction stands from upstream's: semantic pixels agreeing, segments (class, thing) equal and
    their least IoU, instances paired by class and mask: unpaired ones, the largest score difference, the least IoU."""
    out = {}
    if "semantic" in ref:
        out["semantic"] = float((prediction.semantic == ref["semantic"]).mean())
    if "panoptic" in ref:
        ids, segments = ref["panoptic"]
        out["segments_equal"] = [(s.category_id, s.isthing) for s in prediction.segments] == [
            (c, t) for _, c, t in segments]
        out["segment_iou"] = min((_iou(prediction.panoptic == s.id, ids == i)
                                  for s, (i, _, _) in zip(prediction.segments, segments)), default=1.0)
        out["segments"] = len(segments)
    if "instances" in ref:
        theirs = list(ref["instances"])
        score, iou, unpaired = 0.0, 1.0, 0
        for found in prediction.instances:
            mask = decode_mask(found.mask)
            same = [j for j, (label, _, _) in enumerate(theirs) if label == found.label]
            if not same:
                unpaired += 1
                continue
            j = min(same, key=lambda c: (-_iou(mask, theirs[c][2]), abs(theirs[c][1] - found.score)))
            score, iou = max(score, abs(theirs[j][1] - found.score)), min(iou, _iou(mask, theirs[j][2]))
            theirs.pop(j)
        out |= {"unpaired": unpaired + len(theirs), "score": score, "mask_iou": iou,
                "instances": len(prediction.instances)}
    return out


def agrees(f: dict) -> bool:
    return (f.get("semantic", 1) >= SEMANTIC and f.get("segments_equal", True) and f.get("segment_iou", 1) >= IOU
            and f.get("unpaired", 0) == 0 and f.get("score", 0) <= SCORE and f.get("mask_iou", 1) >= IOU)


def served(seed: int, post: dict) -> list:
    outputs = upstream.head_outputs(seed, len(SIZES), (24, 32))
    return [_mask_predictions.mask_prediction(outputs, i, hw, hw, post) for i, hw in enumerate(SIZES)], outputs


def in_graph(seed: int, post: dict) -> list:
    outputs = upstream.head_outputs(seed, len(SIZES), (24, 32))
    with torch.no_grad():
        computed = mask_results.results(torch.from_numpy(outputs["pred_logits"]),
                                        torch.from_numpy(outputs["pred_masks"]), torch.tensor(SIZES), post)
    graph = outputs | {k: v.numpy() for k, v in computed.items()}
    return [_mask_predictions.graph_prediction(graph, i, hw, hw, post) for i, hw in enumerate(SIZES)], outputs


PATHS = {"served": served, "graph": in_graph}


def all_figures(path: str, post: dict) -> list[dict]:
    found = []
    for seed in SEEDS:
        predictions, outputs = PATHS[path](seed, post)
        found += [figures(p, upstream.forward(outputs, i, hw, post))
                  for i, (p, hw) in enumerate(zip(predictions, SIZES))]
    return found


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tasks", [(True, True, True), (True, False, True)])
def test_served_results_are_upstreams(path, tasks):
    post = upstream.post_dict(*tasks)
    found = all_figures(path, post)
    assert all(agrees(f) for f in found), found
    # the cases are not trivial: segments and instances found, and every map has several classes
    assert all(f["instances"] > 3 for f in found)
    if tasks[1]:
        assert sum(f["segments"] for f in found) >= 2 * len(found)


def test_the_head_outputs_reach_each_rule():
    """The random head outputs decide every rule: queries whose best class lies between 0.5 and the object-mask
    threshold, "no object" queries that a softmax without that column would keep, segments dropped by the overlap
    threshold only."""
    unsure = no_object = dropped = 0
    for seed in SEEDS:
        outputs = upstream.head_outputs(seed, len(SIZES), (24, 32))
        probs = upstream._softmax(outputs["pred_logits"])
        best = probs.max(-1)
        unsure += int(((best > 0.5) & (best <= upstream.OBJECT_MASK_THRESHOLD)).sum())
        no_object += int(((probs.argmax(-1) == upstream.K) & (upstream._softmax(
            outputs["pred_logits"][..., :-1]).max(-1) > upstream.OBJECT_MASK_THRESHOLD)).sum())
        for i, hw in enumerate(SIZES):
            kept = upstream.forward(outputs, i, hw, upstream.post_dict())["panoptic"][1]
            loose = upstream.forward(outputs, i, hw, upstream.post_dict() | {"overlap_threshold": 0.5})["panoptic"][1]
            dropped += len(loose) - len(kept)
    assert unsure >= 5 and no_object >= 5 and dropped >= 2, (unsure, no_object, dropped)


# altered rules --------------------------------------------------------------------------------------------------------
def _without_no_object(logits):
    """The "no object" logit at -inf: its column dropped from the softmax."""
    if isinstance(logits, torch.Tensor):
        return torch.cat([logits[..., :-1], torch.full_like(logits[..., -1:], float("-inf"))], -1)
    logits = np.array(logits, np.float32)
    logits[..., -1] = -np.inf
    return logits


def alter(monkeypatch, path: str, rule: str) -> None:
    """One of d2export's rules altered on `path` (served: the _mask_* modules' numpy; graph: mask_results' torch)."""
    if rule == "overlap_threshold":  # the walk over the kept queries, shared by both ways of serving
        segments = _mask_predictions._segments
        monkeypatch.setattr(_mask_predictions, "_segments",
                            lambda w, i, a, l, t, *rest: segments(w, i, a, l, t - 0.3, *rest))
    elif path == "served":
        rules = _mask_rules.Rules
        if rule == "object_mask_threshold":
            panoptic = rules.panoptic
            monkeypatch.setattr(rules, "panoptic", lambda self, c, n, t: panoptic(self, c, n, t - 0.3))
        elif rule == "no_object":
            for name in ("semantic", "instance"):
                monkeypatch.setattr(rules, name, (lambda f: lambda self, c: f(self, _without_no_object(c)))(
                    getattr(rules, name)))
            panoptic = rules.panoptic
            monkeypatch.setattr(rules, "panoptic", lambda self, c, n, t: panoptic(self, _without_no_object(c), n, t))
        elif rule == "score":  # the class probability alone
            of = rules.of
            monkeypatch.setattr(rules, "of", lambda post: dataclasses.replace(of(post), focus_on_box=True))
    else:
        if rule == "object_mask_threshold":
            kept = mask_results.kept_queries
            monkeypatch.setattr(mask_results, "kept_queries", lambda l, post: kept(
                l, post | {"object_mask_threshold": post["object_mask_threshold"] - 0.3}))
        elif rule == "no_object":
            for name in ("semantic_classes", "kept_queries", "instance_classes"):
                monkeypatch.setattr(mask_results, name, (lambda f: lambda l, post: f(_without_no_object(l), post))(
                    getattr(mask_results, name)))
        elif rule == "score":
            monkeypatch.setattr(mask_results, "instance_scores", lambda classes, masks, post: classes)


RULES = ("object_mask_threshold", "overlap_threshold", "no_object", "score")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("path", PATHS)
def test_an_altered_rule_is_refused(path, rule, monkeypatch):
    alter(monkeypatch, path, rule)
    found = all_figures(path, upstream.post_dict())
    assert not all(agrees(f) for f in found), (rule, found)


# an export's eager reference against the model's own inference ------------------------------------------------------
@pytest.fixture(scope="module")
def graph_built(tmp_path_factory):
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("own_inference")
    return pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={out}", "export.postprocess=graph"]))


def _pictures():
    from d2export.tracing import dummy_images

    return dummy_images([(128, 160), (100, 150)], seed=1)


@pytest.fixture
def trained_head(graph_built):
    """The tiny model's head outputs made to reach every rule (seeded weights alone give no "no object" query and
    no segment that loses part of its mask): queries 5+ say "no object", and the masks of queries 0 and 1 overlap
    by half, the rest of the kept queries' masks off there. The model's own forward sees these outputs too."""
    def outputs(module, args, out):
        out = dict(out)
        logits, masks = out["pred_logits"].clone(), out["pred_masks"].clone()
        logits[:, 5:, -1] = logits[:, 5:].max(-1).values + 5
        w = masks.shape[-1]
        masks[:, :5, :, : 3 * w // 4] = -10
        masks[:, 0, :, : w // 2] = 10
        masks[:, 1, :, w // 4 : 3 * w // 4] = 9
        return out | {"pred_logits": logits, "pred_masks": masks}

    hook = graph_built.adapter.head.register_forward_hook(outputs)
    yield
    hook.remove()


def _held(built) -> dict:
    """One verification case's reference, held to the model's own inference as verification holds it."""
    from d2export.verification import served_masks

    record = served_masks.start(built)
    pictures = _pictures()
    served_masks.hold(built, built.adapter.reference(pictures), pictures, record)
    return record


@pytest.mark.parametrize("head", ["seeded", "trained"])
def test_the_reference_is_held_to_the_models_own_inference(graph_built, head, request):
    if head == "trained":
        request.getfixturevalue("trained_head")
    record = _held(graph_built)
    assert record["checked"] and record["methods"] == ["semantic_inference", "panoptic_inference",
                                                       "instance_inference"]
    seen = record["cases"]["128x160+100x150"]
    assert seen["semantic_pixels"] >= SEMANTIC and seen["segment_iou"] >= IOU and seen["mask_iou"] >= IOU
    assert seen["score_diff"] <= SCORE and seen["segments"][0] == seen["segments"][1] > 0
    assert seen["instances"][0] == seen["instances"][1] > 0


@pytest.mark.parametrize("rule", RULES)
def test_an_altered_rule_in_the_graph_is_refused_by_its_reference(graph_built, trained_head, rule, monkeypatch):
    from d2export.verification.comparison import VerificationError

    if rule == "object_mask_threshold":
        # the tiny config's threshold is 0; a segment's query scores under 0.999 on these pictures (seeded weights)
        kept = mask_results.kept_queries
        monkeypatch.setattr(mask_results, "kept_queries", lambda l, post: kept(
            l, post | {"object_mask_threshold": 0.999}))
    else:
        alter(monkeypatch, "graph", rule)
    with pytest.raises(VerificationError, match="differ from the model's own semantic_inference"):
        _held(graph_built)


def test_a_model_without_its_own_inference_says_so():
    from d2export.verification.served_masks import own_methods as _own_methods

    model = SimpleNamespace(semantic_inference=lambda *a: None, instance_inference=lambda *a: None)
    record = _own_methods(model, upstream.post_dict())
    assert record["checked"] is False and record["missing"] == ["panoptic_inference"]
    assert "has no panoptic_inference" in record["why"] and "not the model's own inference" in record["why"]
    assert _own_methods(model, upstream.post_dict(panoptic=False))["checked"] is True
