"""d2export/families/_mask_*.py against Mask2Former's own post-processing: the stand-in's `MaskFormer` (upstream's
semantics; third_party/mask2former) and detectron2's sem_seg_postprocess, run on the same conditioned random graph
outputs. The whole flow goes through the stand-in's eval `forward` with a namespace for `self` whose head returns
those outputs, so padding (ImageList, size divisibility 32), upsampling and the order of steps are upstream's too.
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from d2export.families import _mask_passes, _mask_predictions, _mask_resize, _mask_rules
from d2export.instances import decode_mask

STANDIN = Path(__file__).resolve().parent.parent / "third_party" / "mask2former" / "mask2former" / "maskformer_model.py"
K, Q = 7, 12  # classes (before "no object"), queries
THINGS = [0, 1, 2, 3]  # contiguous ids; 4, 5, 6 are stuff
STUFF_TWICE = 5  # two confident queries of this stuff class: their segments merge
NAMES = [f"class{i}" for i in range(K)]


METHODS = ("forward", "semantic_inference", "panoptic_inference", "instance_inference")


def maskformer_methods(path: Path) -> SimpleNamespace:
    """MaskFormer's inference methods from the text of `path` (the stand-in's file, or upstream's), compiled alone:
    the package around them imports compiled ops and training code, and importing it would register MaskFormer."""
    import ast

    from detectron2.modeling.postprocessing import sem_seg_postprocess
    from detectron2.structures import Boxes, ImageList, Instances
    from detectron2.utils.memory import retry_if_cuda_oom

    tree = ast.parse(path.read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "MaskFormer"]
    defs = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in METHODS]
    scope = {"torch": torch, "F": F, "sem_seg_postprocess": sem_seg_postprocess, "retry_if_cuda_oom": retry_if_cuda_oom,
             "ImageList": ImageList, "Instances": Instances, "Boxes": Boxes}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), scope)
    return SimpleNamespace(**{name: scope[name] for name in METHODS})


@functools.lru_cache(maxsize=1)
def standin() -> SimpleNamespace:
    return maskformer_methods(STANDIN)


def post_dict(before: bool, semantic=True, panoptic=True, instance=True, topk: int = 20) -> dict:
    return {"num_classes": K, "object_mask_threshold": 0.8, "overlap_threshold": 0.8, "test_topk_per_image": topk,
            "semantic_on": semantic, "panoptic_on": panoptic, "instance_on": instance,
            "sem_seg_postprocess_before_inference": before, "thing_ids": THINGS, "class_names": NAMES}


def fake_outputs(seed: int, n: int, mask_hw: tuple[int, int], kind: str = "mixed") -> dict[str, np.ndarray]:
    """Graph outputs a trained model might give: most queries sure of one class (> 0.8), some of "no object", a few
    unsure; each mask a blob (positive inside an ellipse, noisy) so segments overlap partly. Queries 0 and 1 are
    both sure of stuff class STUFF_TWICE. kind "no_object": every query says no object; "empty": every mask negative."""
    g = np.random.default_rng(seed)
    logits = g.normal(0, 1, (n, Q, K + 1)).astype(np.float32)
    for i in range(n):
        for j in range(Q):
            role = g.choice(["sure", "none", "unsure"], p=[0.65, 0.2, 0.15])
            if j < 2:
                logits[i, j, STUFF_TWICE] += 7
            elif kind == "no_object" or role == "none":
                logits[i, j, K] += 7
            elif role == "sure":
                logits[i, j, g.integers(K)] += g.uniform(4, 8)
    mh, mw = mask_hw
    y, x = np.mgrid[0:mh, 0:mw].astype(np.float32)
    masks = np.empty((n, Q, mh, mw), np.float32)
    for i in range(n):
        cells = g.permutation(Q)  # a 3x4 grid of cells, one per query, so most segments keep most of their mask
        for j in range(Q):
            cy, cx = (cells[j] // 4 + g.uniform(0.2, 0.8)) * mh / 3, (cells[j] % 4 + g.uniform(0.2, 0.8)) * mw / 4
            ry, rx = g.uniform(0.3, 0.8) * mh / 3, g.uniform(0.3, 0.8) * mw / 4
            d = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
            masks[i, j] = g.uniform(3, 10) * (1 - d) + g.normal(0, 1, (mh, mw))
    if kind == "empty":
        masks = -np.abs(masks) - 20
    return {"pred_logits": logits, "pred_masks": masks}


def reference(model, outputs: dict[str, np.ndarray], input_hws, original_hws, post: dict) -> list[dict]:
    """`model.forward` (MaskFormer's methods: the stand-in's or upstream's) in eval mode, on pictures of `input_hws`
    asking for `original_hws`, its head returning `outputs`; `self` a namespace with what the methods read."""
    head = SimpleNamespace(num_classes=post["num_classes"])
    self = SimpleNamespace(
        device=torch.device("cpu"), pixel_mean=torch.zeros(3, 1, 1), pixel_std=torch.ones(3, 1, 1),
        size_divisibility=32, training=False, backbone=lambda images: {},
        sem_seg_head=mock.Mock(side_effect=lambda features: {k: torch.from_numpy(v) for k, v in outputs.items()}),
        num_queries=outputs["pred_logits"].shape[1], object_mask_threshold=post["object_mask_threshold"],
        overlap_threshold=post["overlap_threshold"], test_topk_per_image=post["test_topk_per_image"],
        semantic_on=post["semantic_on"], panoptic_on=post["panoptic_on"], instance_on=post["instance_on"],
        sem_seg_postprocess_before_inference=post["sem_seg_postprocess_before_inference"],
        metadata=SimpleNamespace(thing_dataset_id_to_contiguous_id={100 + t: t for t in post["thing_ids"]}))
    self.sem_seg_head.num_classes = head.num_classes
    for name in ("semantic_inference", "panoptic_inference", "instance_inference"):
        setattr(self, name, functools.partial(getattr(model, name), self))
    inputs = [{"image": torch.zeros(3, h, w), "height": H, "width": W}
              for (h, w), (H, W) in zip(input_hws, original_hws)]
    with torch.no_grad():
        return model.forward(self, inputs)


def differences(prediction, ref: dict, input_hw, original_hw, before: bool) -> dict[str, float]:
    """How `prediction` (d2export's) differs from upstream's result `ref` for one picture: pixels whose semantic
    class or panoptic segment differs, whether the segments differ, the instances' largest score difference and
    pixels of differing masks. Upstream's padded-size panoptic map and masks (not postprocessed before inference) are
    first brought to the original picture as d2export does, by torch's nearest resize."""
    (h, w), (H, W) = input_hw, original_hw

    def original(t: torch.Tensor) -> np.ndarray:
        if before:
            return t.numpy()
        return F.interpolate(t[None, None, :h, :w].float(), size=(H, W), mode="nearest")[0, 0].numpy()

    out: dict[str, float] = {}
    if "sem_seg" in ref:
        out["semantic_pixels"] = int((prediction.semantic != ref["sem_seg"].argmax(0).numpy()).sum())
    if "panoptic_seg" in ref:
        ids, segments = ref["panoptic_seg"]
        out["panoptic_pixels"] = int((prediction.panoptic != original(ids)).sum())
        mine = [(s.id, s.category_id, s.isthing) for s in prediction.segments]
        out["segments_differ"] = int(mine != [(s["id"], s["category_id"], s["isthing"]) for s in segments])
    if "instances" in ref:
        inst = ref["instances"]
        theirs = {}
        for score, label, mask in zip(inst.scores.tolist(), inst.pred_classes.tolist(), inst.pred_masks):
            theirs.setdefault(label, []).append((score, original(mask).astype(bool)))
        out["instances_missing"] = abs(len(inst) - len(prediction.instances))
        out["score"] = out["mask_pixels"] = 0
        for found in prediction.instances:
            mask = decode_mask(found.mask)
            # the same label and (nearly) the same mask: upstream's topk order is unspecified
            score, best = min(theirs.get(found.label, [(np.nan, np.zeros_like(mask))]),
                              key=lambda c: (c[1] != mask).sum() + abs(c[0] - found.score))
            out["score"] = max(out["score"], abs(score - found.score))
            out["mask_pixels"] += int((best != mask).sum())
    return out


# the pieces -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, out", [((3, 7, 9), (19, 23)), ((2, 19, 7), (7, 19)), ((10, 10), (10, 10)),
                                        ((4, 40, 36), (333, 517)), ((2, 32, 40), (128, 160))])
def test_resize_is_torch_bilinear(shape, out):
    x = torch.randn(shape)
    want = F.interpolate(x.reshape(-1, 1, *shape[-2:]), size=out, mode="bilinear", align_corners=False)
    np.testing.assert_allclose(_mask_resize.resize_bilinear(x.numpy(), out), want.reshape(*shape[:-2], *out).numpy(),
                               rtol=0, atol=2e-6)


def test_weights_are_torchs_bit_for_bit():
    for size, out in [(40, 333), (7, 19), (36, 517), (13, 31), (200, 57)]:
        eye = torch.eye(size)[None, None]  # interpolating the identity leaves the weights themselves
        want = F.interpolate(eye, size=(out, size), mode="bilinear", align_corners=False)[0, 0].numpy()
        np.testing.assert_array_equal(_mask_resize.resize_weights(size, out), want)


def test_sem_seg_postprocess_is_detectron2s():
    from detectron2.modeling.postprocessing import sem_seg_postprocess

    x = torch.randn(5, 64, 96)
    want = sem_seg_postprocess(x, (50, 77), 143, 211).numpy()
    np.testing.assert_allclose(_mask_resize.sem_seg_postprocess(x.numpy(), (50, 77), 143, 211), want, atol=2e-6)
    # the padded upsampling, the crop and the resize folded into one pass
    masks = torch.randn(Q, 32, 40)
    padded = F.interpolate(masks[None], size=(128, 160), mode="bilinear", align_corners=False)[0]
    want = sem_seg_postprocess(padded, (101, 150), 203, 301).numpy()
    np.testing.assert_allclose(_mask_passes._masks_at(masks.numpy(), (128, 160), (101, 150), (203, 301)), want,
                               atol=5e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inferences_are_upstreams(seed):
    model, post = standin(), post_dict(True)
    outputs = fake_outputs(seed, 1, (45, 61))  # masks at a size of their own, as after sem_seg_postprocess
    cls, masks = outputs["pred_logits"][0], outputs["pred_masks"][0]
    want = model.semantic_inference(SimpleNamespace(), torch.from_numpy(cls), torch.from_numpy(masks)).numpy()
    np.testing.assert_allclose(_mask_predictions.semantic_inference(cls, masks), want, atol=2e-6)

    ns = SimpleNamespace(sem_seg_head=SimpleNamespace(num_classes=K), object_mask_threshold=0.8,
                         overlap_threshold=0.8, metadata=SimpleNamespace(
                             thing_dataset_id_to_contiguous_id={100 + t: t for t in THINGS}),
                         device=torch.device("cpu"), num_queries=Q, test_topk_per_image=20, panoptic_on=True)
    ids, segments = model.panoptic_inference(ns, torch.from_numpy(cls), torch.from_numpy(masks))
    got_ids, got_segments = _mask_predictions.panoptic_inference(cls, masks, K, 0.8, 0.8, THINGS, NAMES)
    np.testing.assert_array_equal(got_ids, ids.numpy())
    assert [(s.id, s.category_id, s.isthing) for s in got_segments] == [
        (s["id"], s["category_id"], s["isthing"]) for s in segments]
    assert all(s.class_name == NAMES[s.category_id] for s in got_segments)
    assert got_ids.dtype == np.int32

    for panoptic_on in (True, False):
        ns.panoptic_on = panoptic_on
        inst = model.instance_inference(ns, torch.from_numpy(cls), torch.from_numpy(masks))
        found = _mask_predictions.instance_inference(cls, masks, K, 20, panoptic_on, THINGS, NAMES)
        assert len(found) == len(inst)
        assert [f.score for f in found] == sorted((f.score for f in found), reverse=True)
        pairs = sorted(zip(inst.scores.tolist(), inst.pred_classes.tolist(),
                           [m.numpy().astype(bool).tobytes() for m in inst.pred_masks]))
        mine = sorted((f.score, f.label, decode_mask(f.mask).tobytes()) for f in found)
        np.testing.assert_allclose([p[0] for p in mine], [p[0] for p in pairs], rtol=1e-5, atol=1e-7)
        assert [p[1:] for p in mine] == [p[1:] for p in pairs]
        assert all(f.box is None and f.class_name == NAMES[f.label] for f in found)
        if panoptic_on:
            assert {f.label for f in found} <= set(THINGS)


# the whole flow -------------------------------------------------------------------------------------------------------
INPUTS = [(101, 150), (120, 90)]  # one batch: padded to 128x160, masks 32x40
ORIGINALS = [(203, 301), (240, 181)]


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prediction_is_upstreams_forward(seed, before):
    post = post_dict(before)
    outputs = fake_outputs(seed, 2, (32, 40))
    refs = reference(standin(), outputs, INPUTS, ORIGINALS, post)
    for i, ref in enumerate(refs):
        prediction = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post)
        assert (prediction.height, prediction.width) == ORIGINALS[i]
        assert prediction.semantic.shape == prediction.panoptic.shape == ORIGINALS[i]
        assert prediction.semantic.dtype == prediction.panoptic.dtype == np.int32
        diff = differences(prediction, ref, INPUTS[i], ORIGINALS[i], before)
        assert diff == {"semantic_pixels": 0, "panoptic_pixels": 0, "segments_differ": 0, "instances_missing": 0,
                        "score": pytest.approx(0, abs=1e-6), "mask_pixels": 0}, diff
        assert len(prediction.segments) > 1 and len(prediction.instances) > 1  # the case is not trivial


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("semantic", [False, True])
def test_instances_alone_upsample_only_their_queries_masks(semantic, before, monkeypatch):
    # COCO instance configs: no panoptic; the top 5 pairs pick a few of the 12 queries, and only theirs are upsampled
    # (where no semantic pass reads the same field), the results upstream's
    post = post_dict(before, semantic=semantic, panoptic=False, topk=5)
    outputs = fake_outputs(5, 2, (32, 40))
    made, upsampled = [], _mask_passes.Upsampled
    monkeypatch.setattr(_mask_predictions, "Upsampled",
                        lambda masks, *a, **k: made.append(len(masks)) or upsampled(masks, *a, **k))
    for i, ref in enumerate(reference(standin(), outputs, INPUTS, ORIGINALS, post)):
        made.clear()
        prediction = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post)
        picked = len(np.unique(_mask_predictions._instance_pairs(outputs["pred_logits"][i], K, 5, False, [],
                                                                 _mask_rules.Rules())[0]))
        assert len(prediction.instances) == 5 and picked < Q
        assert min(made) == (Q if semantic and before else picked)  # the field of the picked queries alone
        assert (prediction.semantic is not None) == semantic and prediction.panoptic is None
        diff = differences(prediction, ref, INPUTS[i], ORIGINALS[i], before)
        assert diff["instances_missing"] == 0 and diff["mask_pixels"] == 0, diff
        assert diff["score"] == pytest.approx(0, abs=1e-6) and diff.get("semantic_pixels", 0) == 0, diff


@pytest.mark.parametrize("seed", [0, 1])
def test_stuff_of_one_class_merges(seed):
    # queries 0 and 1 are both sure of one stuff class: one segment holds what each of them would hold apart
    post = post_dict(True, instance=False)
    outputs = fake_outputs(seed, 1, (32, 40))
    merged = _mask_predictions.mask_prediction(outputs, 0, (128, 160), (128, 160), post)
    apart = fake_outputs(seed, 1, (32, 40))
    # query 1 sure of a thing class instead, as sure: a segment of its own, never merged, the pixels the same
    apart["pred_logits"][0, 1, [STUFF_TWICE, 0]] = apart["pred_logits"][0, 1, [0, STUFF_TWICE]]
    apart = _mask_predictions.mask_prediction(apart, 0, (128, 160), (128, 160), post)

    # queries 0 and 1 come first among the kept ones: apart, segments 1 and 2
    assert [(s.id, s.category_id) for s in apart.segments[:2]] == [(1, STUFF_TWICE), (2, 0)]
    assert merged.segments[0].id == 1 and merged.segments[0].category_id == STUFF_TWICE
    assert STUFF_TWICE not in [s.category_id for s in merged.segments[1:]]
    first, second = (int((apart.panoptic == i).sum()) for i in (1, 2))
    assert first > 0 and second > 0 and int((merged.panoptic == 1).sum()) == first + second
    assert len(merged.segments) == len(apart.segments) - 1


@pytest.mark.parametrize("kind", ["no_object", "empty"])
@pytest.mark.parametrize("before", [True, False])
def test_nothing_found(kind, before):
    post = post_dict(before)
    outputs = fake_outputs(3, 2, (32, 40), kind)
    if kind == "no_object":  # queries 0 and 1 too: no query is kept
        outputs["pred_logits"][:, :, K] += 20
    refs = reference(standin(), outputs, INPUTS, ORIGINALS, post)
    for i, ref in enumerate(refs):
        prediction = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post)
        assert prediction.segments == [] and not prediction.panoptic.any()
        diff = differences(prediction, ref, INPUTS[i], ORIGINALS[i], before)
        assert diff["semantic_pixels"] == diff["panoptic_pixels"] == diff["segments_differ"] == 0
        assert diff["instances_missing"] == 0 and diff["score"] < 1e-6 and diff["mask_pixels"] == 0
        if kind == "empty":  # every mask empty: upstream's instances score 0
            assert all(inst.score == 0 for inst in prediction.instances)
        # a threshold leaves out what scores below it
        assert _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post,
                                                 threshold=0.5).instances == [
            inst for inst in prediction.instances if inst.score >= 0.5]


@pytest.mark.parametrize("originals", [ORIGINALS, [(67, 100), (50, 37)]])  # resized up, and down
@pytest.mark.parametrize("seed", [0, 1])
def test_the_semantic_scores_are_resized_only_at_class_borders(seed, originals, monkeypatch):
    """Semantic results after inference (sem_seg_postprocess resizes K score maps, then the argmax): the argmax is
    made at the graph's size, and an output pixel whose taps agree, decided, takes their class; only the others get
    resized scores. Upstream's forward is matched with every pixel through resized scores and with the shortcut; the
    borders are few, and matter: taking the first tap's class there is wrong."""
    post = post_dict(False, panoptic=False, instance=False)
    outputs = fake_outputs(seed, 2, (32, 40))
    refs = reference(standin(), outputs, INPUTS, originals, post)

    def pixels_off() -> list[int]:
        return [differences(_mask_predictions.mask_prediction(outputs, i, INPUTS[i], originals[i], post), ref,
                            INPUTS[i], originals[i], False)["semantic_pixels"] for i, ref in enumerate(refs)]

    border, sure, resized = _mask_passes._border_classes, _mask_passes._sure, []
    bounds, bounded = _mask_passes._bounded, []
    monkeypatch.setattr(_mask_passes, "_border_classes", lambda *a: resized.append(len(a[-1])) or border(*a))
    monkeypatch.setattr(_mask_passes, "_bounded", lambda *a: bounded.append(bounds(*a)) or bounded[-1])
    assert pixels_off() == [0, 0]
    assert min(b.mean() for b in bounded) > 0.3  # most of the field's pixels decided by their cells' bounds
    assert 0 < sum(resized) < 0.3 * sum(h * w for h, w in originals)
    monkeypatch.setattr(_mask_passes, "_sure", lambda semantic, ri, ci, first: np.zeros(first.shape, bool))
    assert pixels_off() == [0, 0]  # every pixel resized
    assert sum(resized[-2:]) == sum(h * w for h, w in originals)
    monkeypatch.setattr(_mask_passes, "_sure", sure)
    monkeypatch.setattr(_mask_passes, "_border_classes",
                        lambda field, semantic, rows, cols, ys, xs: semantic.map[rows[0][ys, 0], cols[0][xs, 0]])
    assert min(pixels_off()) > 0


def _semantic_both_ways(masks: np.ndarray, classes: np.ndarray, rows, cols):
    """The semantic map and margins of one picture's field from the cells' bounds (where they decide), and from
    every pixel's scores; which pixels the bounds decided."""
    field = _mask_passes.Upsampled(masks, rows, cols)
    bound = _mask_passes._SemanticMap(classes, field.shape[1:], margins=True)
    bounded = _mask_passes._bounded(field, bound)
    every = _mask_passes._SemanticMap(classes, field.shape[1:], margins=True)
    _mask_passes._per_pixel(field, every)
    return bound, every, bounded


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [1, 30])  # trained-like logits; far out of range (probabilities of exactly 0 and 1)
def test_cells_a_bound_decides_are_what_every_pixel_finds(seed, scale):
    """A cell's bound (the least and greatest mask logit over the window its pixels read) decides a class only where
    every pixel's own scores give it that class by the margin: upsampled up and down, non-square, cropped."""
    outputs = fake_outputs(seed, 1, (32, 40))
    masks, classes = outputs["pred_masks"][0] * scale, _mask_rules.softmax(outputs["pred_logits"][0])[:, :-1]
    a, b = np.argsort(classes[2])[-2:]  # query 3 as query 2 with its two best classes swapped: where the two
    masks[3], classes[3] = masks[2], classes[2]  # lead, those classes tie, and no bound may pick one
    classes[3, [a, b]] = classes[2, [b, a]]
    for rows, cols in [(_mask_resize._taps(32, 128, 101), _mask_resize._taps(40, 160, 150)),
                       (_mask_resize._taps(32, 24), _mask_resize._taps(40, 17)), (None, _mask_resize._taps(40, 77))]:
        bound, every, bounded = _semantic_both_ways(masks, classes, rows, cols)
        assert 0.3 < bounded.mean() < 1  # the bounds decide most pixels, not all
        np.testing.assert_array_equal(bound.map[bounded], every.map[bounded])
        assert every.decided[bounded].all()


def test_a_bound_over_too_few_taps_is_caught(monkeypatch):
    # bounds over each cell's first row and column alone (a window one tap wide) decide pixels they do not bound:
    # the comparison with every pixel's scores, and upstream's result, catch it
    outputs = fake_outputs(0, 2, (32, 40))
    masks, classes = outputs["pred_masks"][0], _mask_rules.softmax(outputs["pred_logits"][0])[:, :-1]
    windows = _mask_passes._windows
    monkeypatch.setattr(_mask_passes, "_windows", lambda *a: (windows(*a)[0], 1))
    bound, every, bounded = _semantic_both_ways(masks, classes, _mask_resize._taps(32, 128, 101),
                                                _mask_resize._taps(40, 160, 150))
    assert (bound.map[bounded] != every.map[bounded]).any() or not every.decided[bounded].all()
    post = post_dict(False, panoptic=False, instance=False)
    refs = reference(standin(), outputs, INPUTS, ORIGINALS, post)
    assert sum(differences(_mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post), ref,
                           INPUTS[i], ORIGINALS[i], False)["semantic_pixels"] for i, ref in enumerate(refs)) > 0


def test_weights_below_zero_are_not_bounded():
    # the bounds hold for probabilities as weights (every rule's): with a negative weight the least probability no
    # longer gives the least score, and no cell is decided from them
    outputs = fake_outputs(1, 1, (32, 40))
    classes = _mask_rules.softmax(outputs["pred_logits"][0])[:, :-1]
    classes[0, 0] = -1e-3
    field = _mask_passes.Upsampled(outputs["pred_masks"][0], _mask_resize._taps(32, 128), _mask_resize._taps(40, 160))
    assert _mask_passes._bounded(field, _mask_passes._SemanticMap(classes, field.shape[1:], margins=True)) is None
    classes[0, 0] = np.nan
    assert _mask_passes._bounded(field, _mask_passes._SemanticMap(classes, field.shape[1:], margins=True)) is None


def test_taps_that_are_not_windows_are_not_bounded():
    index, weight = (np.array(a) for a in _mask_resize._taps(8, 20))
    assert _mask_passes._windows((index, weight), 8)[1] == 2
    gap, negative = index.copy(), weight.copy()
    gap[5, 1] += 1  # taps two apart
    negative[5] = (-0.25, 1.25)  # a weight below 0: outputs may leave their taps' range
    assert _mask_passes._windows((gap, weight), 8) is None
    assert _mask_passes._windows((index, negative), 8) is None


@pytest.mark.parametrize("before", [True, False])
def test_results_in_bands_of_rows(before, monkeypatch):
    # a small budget: every result is made a few rows at a time, the bands on threads or one after the other, and
    # must not change
    post = post_dict(before)
    outputs = fake_outputs(4, 2, (32, 40))
    whole = [_mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post) for i in range(2)]
    monkeypatch.setattr(_mask_passes, "_BAND", 3000)
    for each in (_mask_passes._each, lambda fn, items: [fn(x) for x in items]):
        monkeypatch.setattr(_mask_passes, "_each", each)
        for i, ref in enumerate(reference(standin(), outputs, INPUTS, ORIGINALS, post)):
            banded = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post)
            assert len(_mask_passes.Upsampled(outputs["pred_masks"][i], None, None).bands()) > 3  # banded indeed
            np.testing.assert_array_equal(banded.semantic, whole[i].semantic)
            np.testing.assert_array_equal(banded.panoptic, whole[i].panoptic)
            assert banded.segments == whole[i].segments and len(banded.segments) > 1
            assert [(x.label, x.mask) for x in banded.instances] == [(x.label, x.mask) for x in whole[i].instances]
            np.testing.assert_allclose([x.score for x in banded.instances], [x.score for x in whole[i].instances],
                                       rtol=1e-6)
            diff = differences(banded, ref, INPUTS[i], ORIGINALS[i], before)
            assert diff == {"semantic_pixels": 0, "panoptic_pixels": 0, "segments_differ": 0, "instances_missing": 0,
                            "score": pytest.approx(0, abs=1e-6), "mask_pixels": 0}, diff


def test_bad_outputs_are_refused():
    outputs = fake_outputs(0, 1, (8, 8))
    with pytest.raises(ValueError, match="masks cover 32x32"):
        _mask_predictions.mask_prediction(outputs, 0, (40, 20), (40, 20), post_dict(True))
    with pytest.raises(ValueError, match="the manifest says 6"):
        _mask_predictions.mask_prediction(outputs, 0, (32, 32), (32, 32), post_dict(True) | {"num_classes": 6})
    post = post_dict(True)
    del post["overlap_threshold"]
    with pytest.raises(ValueError, match="no 'overlap_threshold'"):
        _mask_predictions.mask_prediction(outputs, 0, (32, 32), (32, 32), post)
    # what a result turned off reads is not needed
    del post["thing_ids"], post["object_mask_threshold"]
    assert _mask_predictions.mask_prediction(outputs, 0, (32, 32), (32, 32),
                                             post | {"panoptic_on": False}).panoptic is None


def test_oneformer_instance_rules():
    """OneFormer's instance_inference beside Mask2Former's: on ADE20K the instance task numbers a class by its place
    among the things' dataset ids (upstream's `thing_indices.index(label)`), its demo mode keeps the pairs whose
    class probability is over the object threshold, DETECTION_ON boxes each mask as detectron2's BitMasks do."""
    from detectron2.structures import BitMasks

    post = post_dict(True)
    outputs = fake_outputs(5, 2, (32, 40))
    refs = reference(standin(), outputs, INPUTS, ORIGINALS, post)
    ids = [3, 1, 0, 2]  # the thing classes' dataset ids in the metadata's order
    rules = {"instance_label_ids": ids, "boxes_from_masks": True}
    for i, ref in enumerate(refs):
        plain = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post)
        served = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post | rules)
        assert len(served.instances) == len(plain.instances) > 1
        assert [x.label for x in served.instances] == [ids.index(x.label) for x in plain.instances]
        assert [x.label for x in served.instances] != [x.label for x in plain.instances]
        assert [x.class_name for x in served.instances] == [x.class_name for x in plain.instances]
        masks = torch.from_numpy(np.stack([decode_mask(x.mask) for x in served.instances]))
        np.testing.assert_array_equal([x.box for x in served.instances], BitMasks(masks).get_bounding_boxes().tensor)
        assert all(x.box is None for x in plain.instances)

        # demo: the top-k pairs by class probability, things, over the threshold (torch on the logits)
        probs = torch.softmax(torch.from_numpy(outputs["pred_logits"][i]), -1)[:, :-1].flatten()
        top, index = probs.topk(post["test_topk_per_image"])
        labels = (index % K).tolist()
        want = sorted(label for p, label in zip(top.tolist(), labels) if p > 0.9 and label in THINGS)
        demo = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i],
                                                 post | {"instance_min_score": 0.9})
        assert sorted(x.label for x in demo.instances) == want and 0 < len(want) < len(plain.instances)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_results_computed_in_the_graph_are_upstreams_at_the_graphs_size(seed):
    """export.postprocess=graph: d2export/tracing/mask_results.py's torch (what the graph computes) on the head's
    outputs, served by graph_prediction, against upstream's forward asked for the pictures at their size in the
    graph: every map, segment, score and mask; and for another size the maps resized by nearest pixels."""
    from d2export.tracing import mask_results

    post = post_dict(True)
    outputs = fake_outputs(seed, 2, (32, 40))
    sizes = torch.tensor(INPUTS, dtype=torch.int64)
    with torch.no_grad():
        computed = mask_results.results(*(torch.from_numpy(outputs[k]) for k in ("pred_logits", "pred_masks")),
                                        sizes, post)
    in_graph = outputs | {k: v.numpy() for k, v in computed.items()}
    for i, ref in enumerate(reference(standin(), outputs, INPUTS, INPUTS, post)):
        served = _mask_predictions.graph_prediction(in_graph, i, INPUTS[i], INPUTS[i], post)
        diff = differences(served, ref, INPUTS[i], INPUTS[i], True)
        assert diff == {"semantic_pixels": 0, "panoptic_pixels": 0, "segments_differ": 0, "instances_missing": 0,
                        "score": pytest.approx(0, abs=1e-6), "mask_pixels": 0}, diff
        assert len(served.segments) > 1 and len(served.instances) > 1
        other = _mask_predictions.graph_prediction(in_graph, i, INPUTS[i], ORIGINALS[i], post)
        np.testing.assert_array_equal(other.semantic, _mask_resize._nearest(served.semantic, INPUTS[i], ORIGINALS[i]))
        assert other.segments == served.segments



def test_subnormal_class_probabilities_change_no_result():
    """Class logits 87-104 apart make softmax probabilities below float32's normal range (slow to multiply on Intel
    cores: the served semantic product is lifted out of it); the semantic map, segments and instances stay
    upstream's."""
    post = post_dict(True)
    outputs = fake_outputs(5, 2, (32, 40))
    outputs["pred_logits"] *= 12
    probs = _mask_rules.softmax(outputs["pred_logits"])
    assert ((probs > 0) & (probs < np.finfo(np.float32).tiny)).sum() > 40  # the case is what it says (a quarter)
    for i, ref in enumerate(reference(standin(), outputs, INPUTS, INPUTS, post)):
        served = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], INPUTS[i], post)
        diff = differences(served, ref, INPUTS[i], INPUTS[i], True)
        assert diff == {"semantic_pixels": 0, "panoptic_pixels": 0, "segments_differ": 0, "instances_missing": 0,
                        "score": pytest.approx(0, abs=1e-6), "mask_pixels": 0}, diff
        assert len(np.unique(served.semantic)) > 2 and len(served.segments) > 1
