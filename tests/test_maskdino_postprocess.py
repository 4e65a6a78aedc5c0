"""MaskDINO's results served by its own rules (d2export/families/_mask_rules.py's Rules): against MaskDINO's inference
(the stand-in in third_party/maskdino, upstream's semantics; with MASKDINO_SRC=<a MaskDINO checkout> upstream's own
`maskdino/maskdino.py` too), through its eval `forward` on the same conditioned random head outputs: sigmoid class
scores without "no object", the panoptic temperature, the cross-entropy semantic scores, boxes scaled to the
original picture over the padded size, instances scored by class alone."""
from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from d2export.families import _mask_predictions
from test_mask_postprocess import INPUTS, K, NAMES, ORIGINALS, Q, THINGS, differences, fake_outputs

STANDIN = Path(__file__).resolve().parent.parent / "third_party" / "maskdino" / "maskdino" / "maskdino.py"
SOURCES = [STANDIN] + ([Path(os.environ["MASKDINO_SRC"]) / "maskdino" / "maskdino.py"]
                       if os.environ.get("MASKDINO_SRC") else [])
METHODS = ("forward", "semantic_inference", "panoptic_inference", "instance_inference", "box_postprocess",
           "class_scores")


@functools.lru_cache(maxsize=None)
def maskdino_methods(path: Path) -> SimpleNamespace:
    """MaskDINO's inference methods from the text of `path`, compiled alone (upstream's module imports its
    criterion, matcher and compiled ops)."""
    from detectron2.modeling.postprocessing import sem_seg_postprocess
    from detectron2.structures import Boxes, ImageList, Instances
    from detectron2.utils.memory import retry_if_cuda_oom

    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MaskDINO"]
    defs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    helpers = [n for n in tree.body if isinstance(n, ast.FunctionDef)]  # the stand-in's box conversion

    def cxcywh_to_xyxy(b):
        cx, cy, w, h = b.unbind(-1)
        return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], -1)

    scope = {"torch": torch, "F": F, "sem_seg_postprocess": sem_seg_postprocess, "retry_if_cuda_oom": retry_if_cuda_oom,
             "ImageList": ImageList, "Instances": Instances, "Boxes": Boxes,
             "box_ops": SimpleNamespace(box_cxcywh_to_xyxy=cxcywh_to_xyxy)}
    exec(compile(ast.Module(body=helpers + defs, type_ignores=[]), str(path), "exec"), scope)
    return SimpleNamespace(**{name: scope.get(name) for name in METHODS})


def post_dict(before=True, semantic=True, panoptic=True, instance=True, transform=True, ce=False, focus=False) -> dict:
    return {"num_classes": K, "object_mask_threshold": 0.25, "overlap_threshold": 0.8, "test_topk_per_image": 20,
            "semantic_on": semantic, "panoptic_on": panoptic, "instance_on": instance,
            "sem_seg_postprocess_before_inference": before, "thing_ids": THINGS, "class_names": NAMES,
            "class_scores": "sigmoid", "transform_eval": transform, "panoptic_temperature": 0.06,
            "semantic_ce_loss": ce, "focus_on_box": focus}


def maskdino_outputs(seed: int, n: int, mask_hw, kind: str = "mixed") -> dict[str, np.ndarray]:
    """Mask2Former's conditioned outputs with K sigmoid classes: "no object" dropped, every class unlikely but the
    sure ones; a box per query."""
    out = fake_outputs(seed, n, mask_hw, kind)
    out["pred_logits"] = out["pred_logits"][..., :K] - 4
    out["pred_boxes"] = np.random.default_rng(seed + 100).uniform(0.1, 0.6, (n, Q, 4)).astype(np.float32)
    return out


def reference(model, outputs, post) -> list[dict]:
    """`model.forward` (MaskDINO's methods) in eval mode on pictures of INPUTS asking for ORIGINALS, its head
    returning `outputs`; `self` a namespace with what the methods read."""
    head = {k: torch.from_numpy(v) for k, v in outputs.items()}
    self = SimpleNamespace(
        device=torch.device("cpu"), pixel_mean=torch.zeros(3, 1, 1), pixel_std=torch.ones(3, 1, 1),
        size_divisibility=32, training=False, backbone=lambda images: {},
        sem_seg_head=mock.Mock(side_effect=lambda features: (head, None)),
        num_queries=Q, object_mask_threshold=post["object_mask_threshold"],
        overlap_threshold=post["overlap_threshold"], test_topk_per_image=post["test_topk_per_image"],
        semantic_on=post["semantic_on"], panoptic_on=post["panoptic_on"], instance_on=post["instance_on"],
        sem_seg_postprocess_before_inference=post["sem_seg_postprocess_before_inference"],
        focus_on_box=post["focus_on_box"], transform_eval=post["transform_eval"],
        pano_temp=post["panoptic_temperature"], semantic_ce_loss=post["semantic_ce_loss"],
        metadata=SimpleNamespace(thing_dataset_id_to_contiguous_id={100 + t: t for t in post["thing_ids"]}))
    self.sem_seg_head.num_classes = K
    for name in METHODS[1:]:
        if getattr(model, name) is not None:
            setattr(self, name, functools.partial(getattr(model, name), self))
    inputs = [{"image": torch.zeros(3, h, w), "height": H, "width": W} for (h, w), (H, W) in zip(INPUTS, ORIGINALS)]
    with torch.no_grad():
        return model.forward(self, inputs)


CASES = {"panoptic, instance, semantic": {}, "no temperature": {"transform": False},
         "scored by box": {"focus": True},
         "semantic only, cross-entropy": dict(panoptic=False, instance=False, ce=True),
         "semantic after inference": dict(before=False, panoptic=False, instance=False)}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: "standin" if p == STANDIN else "upstream")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_prediction_is_maskdinos_forward(source, case, seed):
    post = post_dict(**CASES[case])
    outputs = maskdino_outputs(seed, 2, (32, 40))
    refs = reference(maskdino_methods(source), outputs, post)
    for i, ref in enumerate(refs):
        prediction = _mask_predictions.mask_prediction(outputs, i, INPUTS[i], ORIGINALS[i], post)
        diff = differences(prediction, ref, INPUTS[i], ORIGINALS[i], post["sem_seg_postprocess_before_inference"])
        assert all(v == 0 for k, v in diff.items() if k != "score") and diff.get("score", 0) < 1e-6, diff
        if post["panoptic_on"]:
            assert len(prediction.segments) > 1
        if post["instance_on"]:
            inst = ref["instances"]
            order = np.argsort(-inst.scores.numpy(), kind="stable")
            assert len(prediction.instances) == len(inst) > 1
            np.testing.assert_allclose([x.box for x in prediction.instances], inst.pred_boxes.tensor.numpy()[order],
                                       rtol=1e-6, atol=1e-4)
            if post["focus_on_box"]:  # the class score alone (a sigmoid of numpy's, to an ulp of torch's)
                np.testing.assert_allclose([x.score for x in prediction.instances], inst.scores.numpy()[order],
                                           rtol=1e-6, atol=0)


def test_mask2formers_rules_would_answer_otherwise():
    # the same outputs read as Mask2Former's (a softmax over K + 1 with a last "no object") give other results: the
    # comparison above can tell the rules apart
    post = post_dict()
    outputs = maskdino_outputs(0, 2, (32, 40))
    ref = reference(maskdino_methods(STANDIN), outputs, post)[0]
    wrong = dict(outputs, pred_logits=np.concatenate([outputs["pred_logits"], np.zeros((2, Q, 1), np.float32)], -1))
    served = _mask_predictions.mask_prediction(wrong, 0, INPUTS[0], ORIGINALS[0], post | {"class_scores": "softmax"})
    diff = differences(served, ref, INPUTS[0], ORIGINALS[0], True)
    assert diff["semantic_pixels"] > 0 or diff["panoptic_pixels"] > 0 or diff["segments_differ"]


def test_missing_maskdino_settings_are_named():
    post = post_dict()
    del post["panoptic_temperature"]
    with pytest.raises(ValueError, match="no 'panoptic_temperature'"):
        _mask_predictions.mask_prediction(maskdino_outputs(0, 1, (8, 8)), 0, (32, 32), (32, 32), post)
