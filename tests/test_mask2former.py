"""Mask2Former (the MaskFormer meta-architecture) exported unedited and verified through its masked attention.

The stand-in of third_party/mask2former is written the Mask2Former way: the MSDA op imported at module level, the
COCO evaluator importing detectron2's `_C`, level sizes as Python ints, the attention masks thresholded at 0.5 inside
the network and fixed up by in-place index assignment. Faults and float noise are planted in the graph only (hooks
that act while `torch.onnx.is_in_onnx_export()`), so eager PyTorch, the independent side, never sees them.
"""
from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from d2export import pipeline
from d2export.config import load
from d2export.verification import ladder
from d2export.verification.comparison import VerificationError

SIZES = "verify.sizes=[[128,160],[96,192]]"


def _built(tmp_path, *overrides: str):
    """Two verification sizes and a batch; no lint (a second trace, which these tests do not look at)."""
    return pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={tmp_path}", SIZES, "export.lint=false",
                                                      *overrides]))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("mask2former")
    built = pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={out}"]))
    manifest = pipeline.export(built.cfg, built=built)
    return built, manifest, out / manifest.model_file


@pytest.fixture
def no_ladder(monkeypatch):
    """The parity ladder (run on every failure) is not what these tests look at; it costs a second export."""
    monkeypatch.setattr(ladder, "_ladder_summary", lambda subject: {"culprit": None})


def _decoder(built):
    return built.model.sem_seg_head.predictor


def test_the_unedited_model_is_recognised_and_exports_verified(exported):
    built, manifest, path = exported
    assert built.family.name == "mask2former"
    assert manifest.verification["passed"]
    cases = {c["case"] for c in manifest.verification["cases"]}
    assert any(c.startswith("batch") for c in cases) and len(cases) >= 5
    assert [o.name for o in manifest.outputs] == ["pred_logits", "pred_masks"]
    post = manifest.postprocess
    assert post["num_classes"] == 133 and post["panoptic_on"] and post["instance_on"] and post["semantic_on"]
    assert len(post["class_names"]) == 133 and 0 in post["thing_ids"] and 132 not in post["thing_ids"]


def test_the_attention_masks_are_made_from_shrunk_mask_features_not_from_full_size_products(exported):
    """resize-before-product: each layer's attention mask is the product of the mask features shrunk to its level,
    so no Resize in the graph reads a MatMul's output, and the one full-size product left is `pred_masks`'."""
    import onnx

    _, manifest, path = exported
    graph = onnx.load(str(path)).graph
    made_by = {out: node for node in graph.node for out in node.output}

    def source(name):  # through the reshapes and permutes the product is wrapped in
        node = made_by.get(name)
        while node is not None and node.op_type in ("Reshape", "Transpose", "Unsqueeze", "Squeeze"):
            node = made_by.get(node.input[0])
        return node

    resized = [source(n.input[0]) for n in graph.node if n.op_type == "Resize"]
    assert resized and not any(s is not None and s.op_type == "MatMul" for s in resized)
    assert next(p for p in manifest.patches if p["name"] == "resize-before-product")["hits"] >= 3


def _eager_head(model, images):
    """The head's outputs inside the model's own forward (list[dict], its ImageList padding), captured by a hook."""
    seen = []
    hook = model.sem_seg_head.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            model([{"image": torch.from_numpy(im).float()} for im in images])
    finally:
        hook.remove()
    return seen[-1]["pred_logits"].numpy(), seen[-1]["pred_masks"].numpy()


def test_the_graph_matches_the_models_own_forward_at_sizes_and_batches_it_never_saw(exported):
    built, _, path = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for sizes in ([(117, 203)], [(200, 90)], [(96, 160), (150, 110)]):
        images = [rng.integers(0, 255, (3, h, w), dtype=np.uint8) for h, w in sizes]
        logits, masks = _eager_head(built.model, images)
        feeds = built.adapter.graph_inputs(images)
        got_logits, got_masks = session.run(None, feeds)
        assert got_masks.shape == masks.shape  # the batch padded to 32 as ImageList pads it, at stride 4
        probs = lambda x: torch.softmax(torch.from_numpy(x), -1).numpy()  # noqa: E731
        assert np.abs(probs(got_logits) - probs(logits)).max() < 1e-4
        assert np.abs(got_masks - masks).max() < 1e-3 * max(1.0, np.abs(masks).max())


# --- verification through the attention masks' threshold ----------------------------------------------------------

def plant_threshold_ties(built, graph_noise: float):
    """Mask features zero in eager and graph alike, so every mask logit is exactly 0 and its probability sits on
    the attention masks' 0.5 threshold; in the graph only, plus `graph_noise` × a fixed pattern: below the tolerance
    it is another CPU's rounding (masks flip, nothing else moves), above it a real fault."""
    def hook(_, __, out):
        out = out * 0.0
        if torch.onnx.is_in_onnx_export():
            n = out.shape[1] * out.shape[2] * out.shape[3]
            pattern = torch.sin(torch.arange(n, dtype=out.dtype) * 12.9898).reshape(out.shape[1:])
            out = out + graph_noise * pattern[None]
        return out

    return built.model.sem_seg_head.pixel_decoder.mask_features.register_forward_hook(hook)


def _refused(built) -> str:
    with pytest.raises(VerificationError) as error:
        pipeline.export(built.cfg, built=built)
    return str(error.value)


def test_masks_flipped_by_float_noise_at_the_threshold_pass_by_pinning(tmp_path):
    built = _built(tmp_path)
    plant_threshold_ties(built, graph_noise=1e-6)
    manifest = pipeline.export(built.cfg, built=built)
    pinned = manifest.verification["pinned"]
    assert manifest.verification["passed"] and pinned and all(p["ok"] for p in pinned)
    flips = [s for p in pinned for s in p["selections"] if "Less" in s["node"]]
    assert flips and all(s["positions"] > 0 and s["gap"] <= s["bound"] < 1e-4 for s in flips)


def test_without_pinning_the_same_right_graph_is_refused(tmp_path, no_ladder):
    built = _built(tmp_path, "verify.pin_selections=false")
    plant_threshold_ties(built, graph_noise=1e-6)
    with pytest.raises(VerificationError, match="pred_logits"):
        pipeline.export(built.cfg, built=built)


def test_mask_logits_off_past_the_noise_are_refused_even_on_the_threshold(tmp_path, no_ladder):
    built = _built(tmp_path)
    plant_threshold_ties(built, graph_noise=0.5)
    assert "not float noise" in _refused(built)


def _while_tracing_heads(built, monkeypatch, change):
    """`change(self, outputs_mask, attn_mask, target_size)` → the attention mask the graph uses instead of the
    model's, in the graph only."""
    decoder = type(_decoder(built))
    original = decoder.forward_prediction_heads

    def heads(self, output, mask_features, attn_mask_target_size):
        cls, mask, attn_mask = original(self, output, mask_features, attn_mask_target_size)
        if torch.onnx.is_in_onnx_export():
            attn_mask = change(self, mask, attn_mask, attn_mask_target_size)
        return cls, mask, attn_mask

    monkeypatch.setattr(decoder, "forward_prediction_heads", heads)


def _thresholded(self, mask, size, threshold):
    probs = F.interpolate(mask, size=size, mode="bilinear", align_corners=False).sigmoid()
    return (probs.flatten(2).unsqueeze(1).repeat(1, self.num_heads, 1, 1).flatten(0, 1) < threshold).bool()


def test_a_mask_threshold_of_0_4_is_refused(tmp_path, no_ladder, monkeypatch):
    built = _built(tmp_path)
    _while_tracing_heads(built, monkeypatch, lambda self, mask, attn, size: _thresholded(self, mask, size, 0.4))
    message = _refused(built)
    assert re.search(r"pinning did not clear the case: (no torch.topk, batched NMS or comparison|.*not float noise)",
                     message), message


def test_a_mask_made_at_another_levels_resolution_is_refused(tmp_path, no_ladder, monkeypatch):
    built = _built(tmp_path)

    def other_level(self, mask, attn, size):  # the neighbouring level's mask (twice the size), resized
        finer = F.interpolate(mask, size=(size[0] * 2, size[1] * 2), mode="bilinear", align_corners=False)
        return _thresholded(self, finer, size, 0.5)

    _while_tracing_heads(built, monkeypatch, other_level)
    assert "pinning did not clear the case" in _refused(built)


def test_a_mask_with_one_heads_rows_dropped_is_refused(tmp_path, no_ladder, monkeypatch):
    built = _built(tmp_path)

    def drop_head(self, mask, attn, size):
        heads = attn.view(-1, self.num_heads, *attn.shape[1:]).clone()
        heads[:, 0] = False  # head 0 attends everywhere
        return heads.flatten(0, 1)

    _while_tracing_heads(built, monkeypatch, drop_head)
    # imposing the graph's thresholds cannot explain it: the next layers' masks stand off eager's past the noise
    assert "pinning did not clear the case" in _refused(built)


# --- importing the clone as it is ------------------------------------------------------------------------------------

def test_detectron2s_missing_C_is_stood_in_only_to_import_and_says_so_when_used():
    from d2export.patching import compiled_ops

    module = compiled_ops.make_stand_in("detectron2._C")
    with pytest.raises(RuntimeError, match=r"detectron2._C.COCOevalAccumulate: detectron2 was installed without"):
        module.COCOevalAccumulate()
    assert module.ms_deform_attn_forward is not compiled_ops.ms_deform_attn_forward  # not an MSDA stand-in


def test_an_import_only_module_imports_and_says_what_is_missing_when_used(monkeypatch):
    import sys

    from d2export.patching import compiled_ops

    name = "natten_d2export_test"  # a name nothing installs (OneFormer imports natten for a backbone R-50 never builds)
    monkeypatch.delitem(sys.modules, name, raising=False)
    compiled_ops.install([], import_only=[name])
    try:
        exec(f"from {name} import NeighborhoodAttention2D\n"
             "class Layer(NeighborhoodAttention2D):\n    pass", scope := {})
        with pytest.raises(RuntimeError, match=rf"{name}.NeighborhoodAttention2D: {name} is not installed"):
            scope["Layer"](dim=8)
    finally:
        compiled_ops._finder.names.discard(name)
        compiled_ops._import_only.discard(name)
        sys.modules.pop(name, None)


def test_a_config_adder_that_cannot_be_loaded_is_one_clear_error(tmp_path):
    from d2export import building

    with pytest.raises(building.UserError, match=r"model.cfg_adders='mask2former:nothing' cannot be loaded"):
        pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={tmp_path}",
                                                   "model.cfg_adders=[mask2former:nothing]"]))


def test_standing_in_for_detectron2s_C_keeps_cocos_evaluator_on_its_plain_implementation():
    import subprocess
    import sys

    code = ("import d2export, sys; d2export.activate(['MultiScaleDeformableAttention', 'detectron2._C']); "
            "sys.path.insert(0, 'third_party/mask2former'); import mask2former; "
            "from detectron2.evaluation import coco_evaluation as c; from pycocotools.cocoeval import COCOeval; "
            "import detectron2._C as stub; print(c.COCOeval_opt is COCOeval, getattr(stub, '__d2export_stand_in__'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


# --- heads built on Mask2Former's ------------------------------------------------------------------------------------

def test_a_head_returning_a_tuple_with_boxes_exports_its_boxes_as_a_third_output(tmp_path):
    """MaskDINO's head returns (outputs, denoising record) and a box per query: the adapter unwraps the tuple and
    exports the boxes, verified against the model's own forward like the rest."""
    import dataclasses

    from d2export.tracing.maskformer import MaskFormerAdapter

    built = _built(tmp_path)
    head = built.model.sem_seg_head
    plain = head.forward

    class Pair(tuple):  # (outputs, record) that the stand-in's own forward, written for a dict, can still read
        def __getitem__(self, key):
            return self[0][key] if isinstance(key, str) else super().__getitem__(key)

    def with_boxes(features, mask=None):
        out = plain(features, mask)
        return Pair((out | {"pred_boxes": out["pred_logits"][..., :4].sigmoid()}, {"denoising": None}))

    head.forward = with_boxes
    adapter = MaskFormerAdapter(built.model, *(built.family.preprocess(built.d2cfg)[k] for k in ("pixel_mean",
                                                                                                  "pixel_std")),
                                boxes=True)
    manifest = pipeline.export(built.cfg, built=dataclasses.replace(built, adapter=adapter))
    assert [o.name for o in manifest.outputs] == ["pred_logits", "pred_masks", "pred_boxes"]
    assert manifest.verification["passed"]
    assert {c["output"] for c in manifest.verification["cases"]} == {"pred_logits", "pred_masks", "pred_boxes"}


def test_post_processing_from_the_config_nodes_of_mask2former_maskdino_and_oneformer():
    from detectron2.config import CfgNode

    from d2export.families.mask2former import FAMILY

    test = dict(OBJECT_MASK_THRESHOLD=0.8, OVERLAP_THRESHOLD=0.8, SEMANTIC_ON=True, PANOPTIC_ON=False,
                INSTANCE_ON=True, SEM_SEG_POSTPROCESSING_BEFORE_INFERENCE=False)

    def cfg(model: dict) -> CfgNode:
        return CfgNode({"MODEL": {"SEM_SEG_HEAD": {"NUM_CLASSES": 3}, **model}, "TEST": {"DETECTIONS_PER_IMAGE": 7},
                        "DATASETS": {"TRAIN": ()}})

    mask2former = FAMILY.postprocess(cfg({"MASK_FORMER": {"TEST": test}}))
    maskdino_test = test | {"PANOPTIC_ON": True, "PANO_TRANSFORM_EVAL": True, "PANO_TEMPERATURE": 0.06,
                            "TEST_FOUCUS_ON_BOX": False}
    maskdino = FAMILY.postprocess(cfg({"MaskDINO": {"TEST": maskdino_test, "SEMANTIC_CE_LOSS": True}}))
    semantic_only = FAMILY.postprocess(cfg({"MaskDINO": {"TEST": maskdino_test | {"PANOPTIC_ON": False},
                                                         "SEMANTIC_CE_LOSS": True}}))
    oneformer = FAMILY.postprocess(cfg({"TEST": test | {"TASK": "instance", "INSTANCE_ON": False}}))
    assert mask2former["class_scores"] == "softmax" and "task" not in mask2former
    assert mask2former["test_topk_per_image"] == 7 and mask2former["sem_seg_postprocess_before_inference"]
    assert maskdino["class_scores"] == "sigmoid" and maskdino["panoptic_on"]
    assert maskdino["transform_eval"] and maskdino["panoptic_temperature"] == 0.06 and not maskdino["focus_on_box"]
    # as MaskDINO's from_config: the cross-entropy semantic scores only where panoptic is off
    assert not maskdino["semantic_ce_loss"] and semantic_only["semantic_ce_loss"]
    assert oneformer["task"] == "instance" and not oneformer["instance_on"]
    # OneFormer's instance rules: ADE20K's instance task numbers classes among the things' dataset ids
    from detectron2.data import MetadataCatalog

    MetadataCatalog.get("d2export_test_ade20k_panoptic_train").thing_dataset_id_to_contiguous_id = {7: 2, 5: 0}
    one = dict(MODEL={"SEM_SEG_HEAD": {"NUM_CLASSES": 3}, "ONE_FORMER": {}, "IS_DEMO": False,
                      "TEST": test | {"TASK": "instance", "DETECTION_ON": True}},
               TEST={"DETECTIONS_PER_IMAGE": 7}, DATASETS={"TRAIN": ("d2export_test_ade20k_panoptic_train",)})
    ade = FAMILY.postprocess(CfgNode(one))
    assert ade["instance_label_ids"] == [7, 5] and ade["boxes_from_masks"] and "instance_min_score" not in ade
    one["MODEL"]["IS_DEMO"] = True
    demo = FAMILY.postprocess(CfgNode(one))
    assert demo["instance_min_score"] == 0.8 and "instance_label_ids" not in demo
    assert "instance_label_ids" not in oneformer and "boxes_from_masks" not in mask2former
    # never served by softmax rules: K sigmoid classes, not K + 1
    outputs = {"pred_logits": np.zeros((1, 2, 4), np.float32), "pred_masks": np.zeros((1, 2, 1, 1), np.float32)}
    with pytest.raises(ValueError, match="4 classes; the manifest says 3$"):
        FAMILY.prediction(outputs, 0, (4, 4), (4, 4), maskdino, 0.0)
    with pytest.raises(ValueError, match="the manifest says 3 \\+ 1"):
        FAMILY.prediction(outputs | {"pred_logits": np.zeros((1, 2, 3), np.float32)}, 0, (4, 4), (4, 4),
                          mask2former, 0.0)


def test_bitmask_boxes_equal_detectron2s_loop_and_follow_the_mask_count_in_a_graph(tmp_path):
    """MaskDINO's instance configs box masks with detectron2's loop over them; the rewrite equals it (empty masks
    included) and, traced, serves another count of masks."""
    from detectron2.structures import BitMasks

    from d2export.ops.tensor_ops import mask_boxes

    rng = np.random.default_rng(0)
    masks = torch.from_numpy(rng.random((9, 13, 17)) > 0.93)
    masks[2] = False
    masks[5] = False
    masks[5, 12, 16] = True  # a single corner pixel
    assert torch.equal(mask_boxes(masks), BitMasks(masks).get_bounding_boxes().tensor)

    class Boxing(torch.nn.Module):
        def forward(self, x):
            return mask_boxes(x > 0.9)

    path = tmp_path / "boxes.onnx"
    torch.onnx.export(Boxing(), (torch.rand(3, 13, 17),), str(path), input_names=["x"], output_names=["boxes"],
                      dynamic_axes={"x": {0: "n", 1: "h", 2: "w"}}, opset_version=17, dynamo=False)
    x = rng.random((6, 20, 11)).astype(np.float32)
    [got] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.array_equal(got, BitMasks(torch.from_numpy(x) > 0.9).get_bounding_boxes().tensor.numpy())


def test_post_processing_in_the_graph_is_verified_and_serves_the_default_results(tmp_path):
    """export.postprocess=graph: the semantic map, the panoptic competition and the instance top-k and masks in the
    graph, verified at two sizes and a batch against the same work on the model's own head outputs; served, they
    give the default graph's results but for ties, and the nearest-resized maps elsewhere."""
    from d2export.families import _mask_passes, _mask_predictions
    from d2export.families._mask_predictions import graph_prediction, mask_prediction
    from d2export.runtime.predictor import Predictor

    built = _built(tmp_path, "export.postprocess=graph")
    manifest = pipeline.export(built.cfg, built=built)
    names = [o.name for o in manifest.outputs]
    assert names[:2] == ["pred_logits", "pred_masks"] and "sem_seg" in names and "instance_masks" in names
    assert manifest.verification["passed"] and manifest.postprocess["in_graph"]
    # what serving makes of the eager reference was held to the model's own three inference functions
    own = manifest.verification["own_inference"]
    assert own["checked"] and own["cases"] and all(c["semantic_pixels"] >= 0.999 and c["score_diff"] <= 1e-4
                                                   for c in own["cases"].values())
    assert {c["output"] for c in manifest.verification["cases"]} >= {"sem_seg", "panoptic_query", "query_areas",
                                                                    "instance_scores", "instance_masks"}
    predictor = Predictor(tmp_path / manifest.model_file, threads=1)
    rng = np.random.default_rng(7)
    pictures = [rng.integers(0, 256, (3, h, w), dtype=np.uint8) for h, w in [(128, 160), (120, 150)]]
    feeds = built.adapter.graph_inputs(pictures)
    outputs = dict(zip(predictor.output_names, predictor.session.run(predictor.output_names, feeds)))
    post = manifest.postprocess
    for i, picture in enumerate(pictures):
        hw = picture.shape[1:]
        served, default = graph_prediction(outputs, i, hw, hw, post), mask_prediction(outputs, i, hw, hw, post)
        # the served map's class is, in numpy's scores of the graph's head outputs, the best but for ties (seeded
        # weights: where every mask is off, all scores ~1e-8); tests/test_mask_postprocess.py compares untied
        # results with upstream's
        scores = _mask_predictions.semantic_inference(outputs["pred_logits"][i], _mask_passes._masks_at(
            outputs["pred_masks"][i], outputs["sem_seg"].shape[1:], hw, hw))
        chosen = np.take_along_axis(scores, served.semantic[None], 0)[0]
        assert served.semantic.shape == hw and (scores.max(0) - chosen).max() < 1e-6
        assert served.segments and served.panoptic.shape == hw and served.instances
        assert len(served.instances) == len(default.instances)
        # served to another size: the maps resized by nearest pixels
        bigger = graph_prediction(outputs, i, hw, (2 * hw[0], 2 * hw[1]), post)
        np.testing.assert_array_equal(bigger.semantic[::2, ::2], served.semantic)
        np.testing.assert_array_equal(bigger.panoptic[::2, ::2], served.panoptic)
    # the predictor serves it as it serves the default graph
    found = predictor.predict(np.ascontiguousarray(pictures[0].transpose(1, 2, 0)))
    assert found.semantic.shape == (128, 160) and found.segments and found.instances


def test_post_processing_in_the_graph_is_refused_for_families_without_it(tmp_path):
    from d2export.building import UserError

    with pytest.raises(UserError, match="export.postprocess=graph: the testr family"):
        pipeline.prepare(load("textdet_tiny", [f"export.output_dir={tmp_path}", "export.postprocess=graph"]))


def test_a_wrong_semantic_map_in_the_graph_is_refused_through_the_argmax_pinning(tmp_path, no_ladder, monkeypatch):
    # the graph's map off by one class where its ArgMax picked right: pinning imposes the picks, the map still differs
    from d2export.tracing import mask_results

    real = mask_results.results

    def off_by_one(*args):
        out = real(*args)
        if torch.onnx.is_in_onnx_export():
            out["sem_seg"] = torch.clamp(out["sem_seg"] - 1, min=0)
        return out

    monkeypatch.setattr(mask_results, "results", off_by_one)
    built = _built(tmp_path, "export.postprocess=graph")
    with pytest.raises(VerificationError, match="sem_seg"):
        pipeline.export(built.cfg, built=built)
