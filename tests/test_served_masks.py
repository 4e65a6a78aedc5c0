"""What a segmenter serves by default (the numpy rules of families/_mask_predictions.py on the head's `pred_logits` and
`pred_masks`), held at export to the model's own inference: each verification case's reference outputs served as
the runtime serves them (the family's `prediction` with the manifest's postprocess section) against what the model's
own semantic_inference, panoptic_inference and instance_inference returned in the same forward
(d2export/verification/served_masks.py, called by cases.verification_cases). On the tiny Mask2Former and on a tiny
MaskDINO (the tiny Mask2Former with MaskDINO's head outputs, config node and inference: third_party/maskdino, read
against upstream's maskdino/maskdino.py), both ways of post-processing for MaskDINO; an altered rule is refused.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from d2export import pipeline
from d2export.config import load
from d2export.verification import cases
from d2export.verification.comparison import VerificationError
from d2export.families import AdapterOptions, _mask_rules

SIZES = "verify.sizes=[[128,160],[96,192]]"  # one size the model pads (to 32), one it does not; and a batch of both
STANDIN = Path(__file__).resolve().parent.parent / "third_party" / "maskdino" / "maskdino" / "maskdino.py"
SEMANTIC, IOU, SCORE = 0.999, 0.99, 1e-4


@pytest.fixture(scope="module")
def mask2former(tmp_path_factory):
    out = tmp_path_factory.mktemp("served_masks")
    return pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={out}", SIZES, "export.lint=false"]))


def _standin_maskdino() -> type:
    """third_party/maskdino's MaskDINO, loaded by its path (tests/test_maskdino_proposals.py plays other modules
    named `maskdino`)."""
    spec = importlib.util.spec_from_file_location("maskdino_standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MaskDINO


def as_maskdino(built, postprocess: str = "outside"):
    """The tiny Mask2Former made a tiny MaskDINO: its head returns (outputs, denoising record) with K class logits
    (no "no object" column) scored by sigmoids and a box per query; the model's forward and inference functions are
    MaskDINO's; its config's MODEL.MaskDINO node (PANO_TRANSFORM_EVAL at MaskDINO's temperature) is what the family
    reads, as from a MaskDINO clone."""
    model = copy.deepcopy(built.model)
    k = model.sem_seg_head.num_classes
    head = model.sem_seg_head
    plain = head.forward

    def maskdino_head(features, mask=None):
        out = plain(features, mask)
        # the family's seeded conditioning (class_embed x40, for Mask2Former's softmax) saturates sigmoids: hundreds
        # of (query, class) pairs tie at 1.0 and which of them a top-k keeps is the implementation's (torch's and
        # numpy's differ); spread as a trained MaskDINO's are
        return {"pred_logits": out["pred_logits"][..., :k] / 40, "pred_masks": out["pred_masks"],
                "pred_boxes": out["pred_logits"][..., k - 4 : k].sigmoid()}, None

    head.forward = maskdino_head
    head.predictor.bbox_embed = torch.nn.Identity()  # how the family tells that the head returns boxes
    model.__class__ = type("TinyMaskDINO", (_standin_maskdino(), type(model)), {})
    model.pano_temp, model.transform_eval, model.semantic_ce_loss, model.focus_on_box = 0.06, True, False, False
    d2cfg = built.d2cfg.clone()
    d2cfg.defrost()
    node = d2cfg.MODEL.pop("MASK_FORMER")
    node.TEST.update(PANO_TRANSFORM_EVAL=True, PANO_TEMPERATURE=0.06, TEST_FOUCUS_ON_BOX=False)
    node["SEMANTIC_CE_LOSS"] = False
    d2cfg.MODEL["MaskDINO"] = node
    adapter = built.family.adapter(model, d2cfg, AdapterOptions(postprocess=postprocess))
    return dataclasses.replace(built, d2cfg=d2cfg, model=model, adapter=adapter)


def _held(built) -> dict:
    """Verification's eager references (what this file looks at: the served results' check made with them)."""
    cases.verification_cases(built)
    return built.adapter.own_inference


def _agrees(record: dict) -> None:
    assert record["checked"] and len(record["cases"]) == 3, record
    for case in record["cases"].values():
        assert case["semantic_pixels"] + case["semantic_tied"] >= SEMANTIC, case
        assert case["segments"][0] == case["segments"][1] and case.get("segment_iou", 1.0) >= IOU, case
        assert case["instances"][0] == case["instances"][1] > 0, case
        assert case["score_diff"] <= SCORE and case["mask_iou"] >= IOU, case


def test_the_default_served_results_are_the_models_own(mask2former):
    record = _held(mask2former)
    assert record["postprocess"] == "served"
    assert record["methods"] == ["semantic_inference", "panoptic_inference", "instance_inference"]
    _agrees(record)
    assert sum(c["segments"][0] for c in record["cases"].values()) > 0


@pytest.mark.parametrize("postprocess", ["outside", "graph"])
def test_maskdinos_served_results_are_its_own(mask2former, postprocess):
    built = as_maskdino(mask2former, postprocess)
    post = built.family.postprocess(built.d2cfg)
    assert post["class_scores"] == "sigmoid" and post["transform_eval"] and not post["semantic_ce_loss"]
    record = _held(built)
    assert record["postprocess"] == ("graph" if postprocess == "graph" else "served")
    _agrees(record)


def _altered(monkeypatch, rule: str) -> None:
    rules = _mask_rules.Rules
    if rule == "score":  # instances scored by their class alone, not class x mask
        of = rules.of
        monkeypatch.setattr(rules, "of", lambda post: dataclasses.replace(of(post), focus_on_box=True))
    elif rule == "sigmoid":  # MaskDINO's instance classes by a softmax instead of its sigmoids
        monkeypatch.setattr(rules, "instance", lambda self, logits: _mask_rules.softmax(logits))
    elif rule == "temperature":  # MaskDINO's semantic and panoptic scores without the sharpening softmax
        monkeypatch.setattr(rules, "_sharpened", lambda self, logits: _mask_rules.sigmoid(logits))


@pytest.mark.parametrize("model, rule", [("mask2former", "score"), ("maskdino", "sigmoid"),
                                         ("maskdino", "temperature")])
def test_an_altered_default_rule_is_refused(mask2former, model, rule, monkeypatch):
    built = mask2former if model == "mask2former" else as_maskdino(mask2former)
    _altered(monkeypatch, rule)
    with pytest.raises(VerificationError, match="results served from the head's outputs .served rules. differ"):
        _held(built)
