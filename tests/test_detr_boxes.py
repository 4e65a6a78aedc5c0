"""detrex-form DETR box detectors (third_party/detrex_standin: Deformable DETR two-stage + box refinement, DINO)
through `model.lazy_config`: loading and overrides, recognition, export + verification, and parity of the exported
graph with the model's own eager forward (list[dict] in, Instances after its own post-processing out) at sizes
other than the export's, through the serving Predictor."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import d2export
from d2export import families, pipeline
from d2export.building import UserError
from d2export.config import load
from d2export.families.detr_boxes import DETECTOR
from d2export.resizing import synthetic_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "third_party", "detrex_standin")
TINY = {"deformable_detr": "deformable_detr_tiny", "dino": "dino_tiny"}


@pytest.fixture(scope="module", params=list(TINY))
def exported(request, tmp_path_factory):
    """Each tiny stand-in exported once with the default pipeline (five sizes, a mixed batch, lint)."""
    out = tmp_path_factory.mktemp(request.param)
    cfg = load(TINY[request.param], [f"export.output_dir={out}"])
    manifest = pipeline.export(cfg)
    return cfg, manifest, out / manifest.model_file


def test_the_compiled_op_is_served_by_name_and_needed():
    """Without d2export's hook, the stand-in (like detrex) degrades its MSDA to a class that refuses to build."""
    assert "detrex._C" in d2export.DEFAULT_COMPILED_OPS
    code = ("import sys; sys.path.insert(0, {!r}); {}"
            "from detrex.layers import MultiScaleDeformableAttention as M; M(); print('built')")
    for hook, expect in (("", "detrex._C"), ("import d2export; d2export.activate(); ", "built")):
        r = subprocess.run([sys.executable, "-c", code.format(STANDIN, hook)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        assert expect in r.stdout + r.stderr, r.stderr[-2000:]


def test_lazy_overrides_reach_the_built_model_and_the_manifest_sections():
    cfg = load("deformable_detr_tiny", ["export.output_dir=unused", "model.lazy_overrides=['model.num_queries=12',"
                                        "'model.select_box_nums_for_evaluation=7',"
                                        "'dataloader.test.mapper.augmentation.0.short_edge_length=96']"])
    built = pipeline.prepare(cfg)
    assert built.family.name == "detr_boxes"
    assert built.model.transformer.two_stage_num_proposals == 12  # through the config's own interpolation
    assert built.model.select_box_nums_for_evaluation == 7
    assert built.adapter.head.mask_rule == 1  # the stand-in's (detrex's current) `[:(h - 1), :(w - 1)]`, as seen
    pre, post = built.family.preprocess(built.d2cfg), built.family.postprocess(built.d2cfg)
    assert pre["input_format"] == "RGB" and (pre["min_size_test"], pre["max_size_test"]) == (96, 256)
    assert pre["pixel_mean"] == pytest.approx([123.675, 116.28, 103.53])
    from detectron2.data import MetadataCatalog

    assert post["class_names"] == list(MetadataCatalog.get("coco_2017_val").thing_classes)
    assert post["class_names"][0] == "person" and len(post["class_names"]) == 80


@pytest.mark.parametrize("overrides, needle", [
    (["model.d2_config=configs/detectron2/faster_rcnn_R_18_FPN_small.yaml"], "got both"),
    (["model.lazy_config=null"], "got neither"),
])
def test_exactly_one_of_the_two_config_kinds(overrides, needle):
    with pytest.raises(ValueError, match=needle) as e:
        load("deformable_detr_tiny", ["export.output_dir=unused", *overrides])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    (["model.lazy_config=nowhere/none.py"], "no such file"),
    (["model.lazy_overrides=['model.no_such_key.deeper=1']"], "no_such_key"),
    (["model.lazy_overrides=['model.backbone.stages.depth=7']"], "instantiating"),
])
def test_bad_lazy_configs_give_one_line_errors(overrides, needle):
    with pytest.raises(UserError, match=needle) as e:
        pipeline.prepare(load("deformable_detr_tiny", ["export.output_dir=unused", *overrides]))
    assert "\n" not in str(e.value)


class _Module(nn.Module):
    def __init__(self, *attrs):
        super().__init__()
        for a in attrs:
            setattr(self, a, nn.Identity())


def test_recognition_misses_are_one_line_and_name_what_is_lacking():
    with pytest.raises(families.FamilyError, match="detr_boxes: .*lacks .*select_box_nums_for_evaluation") as e:
        families.recognise(_Module("backbone", "neck", "transformer"))
    assert "\n" not in str(e.value)
    # everything a detrex detector has, but no inverse_sigmoid beside it (this test module defines none)
    lookalike = _Module(*DETECTOR)
    with pytest.raises(families.FamilyError, match="inverse_sigmoid"):
        families.recognise(lookalike, "detr_boxes")


class _MaskedDetector(nn.Module):
    """A detector's forward up to its position embedding, building padding masks by `rule` as detrex releases do:
    ones zeroed over each image short of its size by `rule` rows and columns, or (None) no mask."""

    def __init__(self, rule, stride):
        super().__init__()
        self.rule, self.stride = rule, stride
        self.position_embedding = nn.Identity()

    def forward(self, batched_inputs):
        from detectron2.structures import ImageList

        images = ImageList.from_tensors([x["image"] for x in batched_inputs])
        n, _, H, W = images.tensor.shape
        masks = images.tensor.new_zeros(n, H, W) if self.rule is None else images.tensor.new_ones(n, H, W)
        for i, (h, w) in enumerate(images.image_sizes if self.rule is not None else []):
            masks[i, :h - self.rule, :w - self.rule] = 0
        feat = F.avg_pool2d(images.tensor, self.stride, ceil_mode=True)
        self.position_embedding(F.interpolate(masks[None], size=feat.shape[-2:]).to(torch.bool)[0])
        raise AssertionError("the probe must stop at the position embedding")


@pytest.mark.parametrize("stride", [8, 16])
def test_the_padding_mask_rule_is_read_off_the_models_own_forward(stride):
    from d2export.tracing.detrex import mask_rule

    for rule in (1, 0, None):
        assert mask_rule(_MaskedDetector(rule, stride)) == rule
    with pytest.raises(ValueError, match="none of the known rules"):
        mask_rule(_MaskedDetector(2, stride))


def test_export_verifies_at_five_sizes_and_a_mixed_batch_with_a_clean_lint(exported):
    _, manifest, _ = exported
    v = manifest.verification
    assert manifest.family == "detr_boxes" and v["passed"] is True
    sizes = [c["case"] for c in v["cases"]]
    assert len({s for s in sizes if not s.startswith("batch ")}) == 5 and any(s.startswith("batch ") for s in sizes)
    assert v["lint"]["size_dependent_constants"] == [] and v["lint"]["identical"] is not False
    assert [(o.name, o.shape) for o in manifest.outputs] == [
        ("boxes", ["batch", 20, 4]), ("scores", ["batch", 20]), ("labels", ["batch", 20])]
    applied = {p["name"] for p in manifest.patches if p["status"] == "applied"}
    assert {"msda-core", "sizes-as-tensor", "reference-points-per-level", "encoder-proposals-per-level"} <= applied


def _own_forward(model, prepared, pictures):
    """The model's own forward on list[dict] (one batch), its Instances after its own detector_postprocess."""
    inputs = [{"image": torch.from_numpy(p.chw).float(), "height": pic.shape[0], "width": pic.shape[1]}
              for p, pic in zip(prepared, pictures)]
    with torch.no_grad():
        outs = model(inputs)
    return [(o["instances"].pred_boxes.tensor.numpy(), o["instances"].scores.numpy(),
             o["instances"].pred_classes.numpy()) for o in outs]


def _compare(prediction, reference, names):
    boxes, scores, labels = reference
    assert len(prediction.instances) == len(scores) > 0
    np.testing.assert_allclose([i.box for i in prediction.instances], boxes, atol=2e-2, rtol=1e-4)
    np.testing.assert_allclose([i.score for i in prediction.instances], scores, atol=1e-5, rtol=1e-4)
    assert [i.label for i in prediction.instances] == labels.tolist()
    assert [i.class_name for i in prediction.instances] == [names[k] for k in labels]


def test_served_graph_matches_the_models_own_forward_at_other_sizes(exported):
    """Pictures of sizes the export never saw, resized by the Predictor; the model's own forward gets the same
    resized input and the original size, and post-processes (rescale, clip, drop empty) itself."""
    from d2export.runtime import Predictor

    cfg, manifest, path = exported
    model = pipeline.prepare(cfg).model  # the same seeded model
    predictor = Predictor(path, score_threshold=0.0)
    pictures = [synthetic_image(h, w, seed).transpose(1, 2, 0).copy()
                for seed, (h, w) in enumerate([(301, 187), (120, 410), (233, 233)])]
    names = manifest.postprocess["class_names"]
    prepared = [predictor.prepare(p) for p in pictures]
    assert all(p.chw.shape[1:] != (160, 224) for p in prepared)
    for picture, p in zip(pictures, prepared):
        _compare(predictor.predict(picture), _own_forward(model, [p], [picture])[0], names)
    # mixed sizes in one run: the graph's padding masks come from image_sizes, as the model's from its ImageList
    for got, reference in zip(predictor.predict_batch(pictures), _own_forward(model, prepared, pictures)):
        _compare(got, reference, names)


def test_served_over_http_with_boxes_and_class_names(exported):
    import io

    import httpx
    from PIL import Image

    from d2export.runtime import Predictor
    from d2export.runtime.server import create_app, serving

    predictor = Predictor(exported[2], threads=1)
    picture = synthetic_image(150, 230, 5).transpose(1, 2, 0).copy()
    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, "PNG")
    want = predictor.predict(picture, score_threshold=0.0).instances
    with serving(create_app(predictor)) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/predict?score_threshold=0", content=buf.getvalue(), headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    got = r.json()["instances"]
    assert len(got) == len(want) > 0
    assert [(g["label"], g["class_name"]) for g in got] == [(w.label, w.class_name) for w in want]
    np.testing.assert_allclose([g["box"] for g in got], [w.box for w in want], atol=0.006)  # JSON: 1/100 px
