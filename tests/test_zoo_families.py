"""detectron2's own model zoo (the YAMLs inside the installed detectron2) through families rcnn, retinanet and
panoptic_fpn: export + verification at a size and its transpose, and the onnxruntime Predictor against detectron2's
DefaultPredictor on pictures of other sizes (boxes, scores, classes, pasted masks, keypoints).

The zoo configs are shrunk with detectron2 opts (ResNet-18 trunk, thin heads, few proposals, small test sizes) so each
model exports in seconds; the structure (FPN, heads, post-processing) is the zoo's own.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from d2export import pipeline
from d2export.config import load
from d2export.instances import decode_mask
from d2export.runtime.predictor import Predictor

REPO = Path(__file__).resolve().parent.parent
SMALL = ["MODEL.RESNETS.DEPTH", "18", "MODEL.RESNETS.RES2_OUT_CHANNELS", "64", "MODEL.FPN.OUT_CHANNELS", "32",
         "MODEL.RPN.PRE_NMS_TOPK_TEST", "200", "MODEL.RPN.POST_NMS_TOPK_TEST", "30", "TEST.DETECTIONS_PER_IMAGE", "8",
         "MODEL.ROI_BOX_HEAD.FC_DIM", "64", "MODEL.ROI_MASK_HEAD.CONV_DIM", "32", "MODEL.ROI_MASK_HEAD.NUM_CONV", "1",
         "MODEL.ROI_KEYPOINT_HEAD.CONV_DIMS", "(32, 32)", "MODEL.SEM_SEG_HEAD.CONVS_DIM", "32",
         "MODEL.RETINANET.NUM_CONVS", "1", "INPUT.MIN_SIZE_TEST", "160", "INPUT.MAX_SIZE_TEST", "256",
         # random weights score ~1/81 per class: a low threshold gives both sides detections to compare
         "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.005", "MODEL.RETINANET.SCORE_THRESH_TEST", "0.004",
         # small pictures: stuff regions and (random) things take part in the panoptic combination
         "MODEL.PANOPTIC_FPN.COMBINE.STUFF_AREA_LIMIT", "256",
         "MODEL.PANOPTIC_FPN.COMBINE.INSTANCES_CONFIDENCE_THRESH", "0.01"]
MODELS = {  # zoo name → (family, outputs, classes)
    "COCO-Detection/retinanet_R_50_FPN_1x.yaml": ("retinanet", ["boxes", "scores", "labels"], 80),
    "COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_1x.yaml": ("rcnn", ["boxes", "scores", "labels", "masks"], 80),
    "COCO-Keypoints/keypoint_rcnn_R_50_FPN_1x.yaml": ("rcnn", ["boxes", "scores", "labels", "keypoints"], 1),
    "COCO-PanopticSegmentation/panoptic_fpn_R_50_1x.yaml": ("panoptic_fpn",
                                                            ["boxes", "scores", "labels", "masks", "sem_seg"], 80),
}
EXPORT_HW = (160, 224)
PICTURES = [(150, 230), (260, 170)]  # original sizes the Predictor resizes (non-square, other aspect ratios)


def zoo_config(name: str, out: Path, *more: str):
    return load("rcnn", [f"model.d2_config={name}", "model.family=auto", "model.opts=[" + ",".join(f"'{o}'" for o in SMALL) + "]",
                         f"export.output_dir={out}", f"export.dummy_sizes=[[{EXPORT_HW[0]},{EXPORT_HW[1]}]]",
                         f"verify.sizes=[[{EXPORT_HW[0]},{EXPORT_HW[1]}],[{EXPORT_HW[1]},{EXPORT_HW[0]}]]",
                         "export.lint=false", *more])


def tame_weights(name: str, path: Path) -> Path:
    """The seeded random model with its box regressors, RetinaNet's classifier and the keypoint predictor scaled down,
    saved as a checkpoint: fully random deltas throw boxes out of the picture, a random RetinaNet scores everything
    1.0, and random keypoint logits in the thousands make exp-normalised keypoint scores ill-conditioned."""
    from d2export import building

    cfg = zoo_config(name, path)
    model, _ = building.build_model(cfg.model, building.load_d2_config(cfg.model, REPO), REPO)
    scaled = ("bbox_pred", "head.cls_score.weight", "keypoint_head.score_lowres")
    tame = {k: v * 0.01 if any(s in k for s in scaled) else v for k, v in model.state_dict().items()}
    torch.save({"model": tame}, path / "tame.pth")
    return path / "tame.pth"


@pytest.fixture(scope="module", params=list(MODELS), ids=lambda n: Path(n).stem)
def exported(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo")
    weights = tame_weights(request.param, tmp_path_factory.mktemp("weights"))
    cfg = zoo_config(request.param, out, f"model.weights={weights}")
    manifest = pipeline.export(cfg)
    return request.param, cfg, manifest, out / manifest.model_file


def test_zoo_model_exports_and_verifies_at_a_size_and_its_transpose(exported):
    name, cfg, manifest, _ = exported
    family, outputs, classes = MODELS[name]
    assert manifest.family == family
    assert [t.name for t in manifest.inputs] == ["images", "image_sizes"]
    assert manifest.inputs[0].shape == [1, 3, "height", "width"]  # batch fixed: detectron2 unrolls it
    assert [t.name for t in manifest.outputs] == outputs and all(t.doc for t in manifest.outputs)
    assert manifest.outputs[0].shape == [1, "detections", 4]
    v = manifest.verification
    h, w = EXPORT_HW
    assert v["passed"] is True and {c["case"] for c in v["cases"]} == {f"{h}x{w}", f"{w}x{h}"}
    post = manifest.postprocess
    assert post["class_names"][0] == "person" and len(post["class_names"]) == classes  # COCO, from detectron2's metadata
    assert post["score_threshold"] == (0.004 if family == "retinanet" else 0.005)  # the model's own, not the graph's 0


def _default_predictor(cfg):
    """detectron2's DefaultPredictor on the same config and weights (independent of d2export's graph)."""
    from detectron2.engine import DefaultPredictor

    from d2export import building

    d2cfg = building.load_d2_config(cfg.model, REPO).clone()
    d2cfg.defrost()
    d2cfg.MODEL.WEIGHTS = cfg.model.weights
    return DefaultPredictor(d2cfg)


def test_predictor_matches_detectron2_default_predictor(exported):
    name, cfg, manifest, model_path = exported
    predictor = Predictor(model_path, threads=1)
    reference = _default_predictor(cfg)
    rng = np.random.default_rng(5)
    compared = 0
    for h, w in PICTURES:
        bgr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        bgr[h // 4 : h // 2, w // 3 : w // 2] = rng.integers(0, 60)  # a dark patch: some structure to detect
        prediction = predictor.predict(bgr, format="BGR")
        with torch.no_grad():
            out = reference(bgr)
        want = out["instances"]
        assert (prediction.height, prediction.width) == (h, w)
        got = [i for i in prediction.instances if not i.stuff]
        assert len(got) == len(want) > 0, (name, h, w)
        boxes = np.array([i.box for i in got])
        np.testing.assert_allclose(boxes, want.pred_boxes.tensor.numpy(), atol=0.02)
        np.testing.assert_allclose([i.score for i in got], want.scores.numpy(), atol=1e-4)
        assert [i.label for i in got] == want.pred_classes.tolist()
        names = manifest.postprocess["class_names"]
        assert [i.class_name for i in got] == [names[c] for c in want.pred_classes.tolist()]
        if "panoptic_seg" in out:  # the stuff regions of detectron2's panoptic combination
            segments, info = out["panoptic_seg"]
            stuff = [i for i in prediction.instances if i.stuff]
            want_stuff = [s for s in info if not s["isthing"]]
            assert [i.label for i in stuff] == [s["category_id"] for s in want_stuff] and stuff
            for inst, s in zip(stuff, want_stuff):
                assert (decode_mask(inst.mask) != (segments == s["id"]).numpy()).mean() < 1e-3
                assert inst.class_name == manifest.postprocess["stuff_classes"][s["category_id"]]
        if want.has("pred_masks"):
            masks = np.stack([decode_mask(i.mask) for i in got])
            assert masks.shape == tuple(want.pred_masks.shape)
            assert (masks != want.pred_masks.numpy()).mean() < 1e-3  # ≥ 0.5 may flip on a boundary pixel
            assert masks.any()
        if want.has("pred_keypoints"):
            kp = np.array([i.keypoints for i in got])
            ref = want.pred_keypoints.numpy()
            assert kp.shape == ref.shape and (kp[..., 0] < w + 1).all()
            moved = np.abs(kp[..., :2] - ref[..., :2]).max(-1)
            assert (moved < 0.05).mean() > 0.9 and moved.max() < 1.5  # an argmax may move a pixel on a near-tie
            np.testing.assert_allclose(kp[..., 2][moved < 0.05], ref[..., 2][moved < 0.05], rtol=1e-3)
        compared += len(want)
    assert compared > 0


def test_predictor_splits_a_batch_for_a_fixed_batch_graph(exported):
    name, _, _, model_path = exported
    predictor = Predictor(model_path, threads=1)
    rng = np.random.default_rng(9)
    pictures = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in PICTURES]
    one_by_one = [predictor.predict(p) for p in pictures]
    batched = predictor.predict_batch(pictures)
    assert [p.to_dict() for p in batched] == [p.to_dict() for p in one_by_one]
    with pytest.raises(ValueError, match="at most 1 picture"):
        predictor.run([predictor.prepare(p) for p in pictures])


def test_unsupported_zoo_model_is_refused_in_one_line(tmp_path):
    """A semantic segmentor fits no family: the CLI says so in one line and writes nothing."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "export.py"), "--config", "rcnn",
         "model.d2_config=Misc/semantic_R_50_FPN_1x.yaml", "model.family=auto", f"export.output_dir={tmp_path}",
         "model.opts=[MODEL.RESNETS.DEPTH,18,MODEL.RESNETS.RES2_OUT_CHANNELS,64]"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "no model family fits SemanticSegmentor" in last and "rcnn:" in last and "retinanet:" in last
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]  # the export lock may stay


def test_zoo_name_that_does_not_exist_is_refused_in_one_line(tmp_path):
    with pytest.raises(Exception, match="COCO-Detection/nope.yaml.*nor .*detectron2's model zoo"):
        pipeline.prepare(zoo_config("COCO-Detection/nope.yaml", tmp_path))


# ------------------------------------------------ serving-side pieces against detectron2's / torch's own (float64)
def test_paste_mask_matches_detectron2_paste_masks_in_image():
    from detectron2.layers.mask_ops import paste_masks_in_image

    from d2export.families._detections import paste_mask

    rng = np.random.default_rng(3)
    h, w = 37, 53
    masks = rng.random((6, 28, 28))
    xy = rng.uniform(-10, 30, (6, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(12, 40, (6, 2))], 1)  # some past the picture's edges
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)  # detector_postprocess clips before pasting
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
    want = paste_masks_in_image(torch.from_numpy(masks), torch.from_numpy(boxes), (h, w), threshold=-1)
    got = np.stack([paste_mask(m, b, h, w) for m, b in zip(masks, boxes)])
    np.testing.assert_allclose(got, want.numpy() / 255.0, atol=1 / 255 + 1e-6)  # detectron2 quantises to uint8
    want_bool = paste_masks_in_image(torch.from_numpy(masks), torch.from_numpy(boxes), (h, w), threshold=0.5)
    assert ((got >= 0.5) != want_bool.numpy()).mean() < 1e-3 and want_bool.any()


@pytest.mark.parametrize("with_pycocotools", [True, False])
def test_mask_rle_round_trips_and_is_coco_rle(with_pycocotools, monkeypatch):
    from pycocotools import mask as coco_mask

    from d2export.instances import encode_mask

    rng = np.random.default_rng(4)
    masks = [rng.random((23, 31)) > 0.6, np.zeros((5, 7), bool), np.ones((4, 9), bool)]
    masks[0][0, 0] = True
    for mask in masks:
        with monkeypatch.context() as m:
            if not with_pycocotools:
                m.setitem(sys.modules, "pycocotools", None)  # the fallback: uncompressed counts
            rle = encode_mask(mask)
            np.testing.assert_array_equal(decode_mask(rle), mask)
        assert isinstance(rle["counts"], str) == with_pycocotools and rle["size"] == list(mask.shape)
        coco = ({"size": rle["size"], "counts": rle["counts"].encode()} if with_pycocotools
                else coco_mask.frPyObjects(rle, *rle["size"]))  # COCO's own tools read either form
        np.testing.assert_array_equal(coco_mask.decode(coco).astype(bool), mask)


@pytest.mark.parametrize("size, out", [(7, 19), (19, 7), (10, 10), (13, 31)])
def test_semantic_resize_matches_torch_bilinear(size, out):
    from torch.nn import functional as F

    from d2export.families._mask_resize import resize_bilinear

    x = torch.randn(3, size, size + 2)  # float32, as the graph's logits: the weights are torch's float32 ones
    want = F.interpolate(x[None], size=(out, out + 5), mode="bilinear", align_corners=False)[0]
    np.testing.assert_allclose(resize_bilinear(x.numpy(), (out, out + 5)), want.numpy(), atol=1e-6)


def test_vis_overlays_masks_and_draws_keypoints():
    from d2export.instances import Instance, Prediction, encode_mask
    from d2export.runtime.visualize import draw_prediction

    image = np.full((40, 60, 3), 200, np.uint8)
    mask = np.zeros((40, 60), bool)
    mask[10:20, 30:50] = True
    prediction = Prediction(40, 60, [Instance(0.9, 0, "person", box=[28.0, 8.0, 52.0, 22.0], mask=encode_mask(mask),
                                              keypoints=[[5.0, 30.0, 0.8]])])
    drawn = np.asarray(draw_prediction(image, prediction, show_scores=False))
    assert (drawn[14, 40] != 200).any()  # inside the mask: tinted
    assert (drawn[35, 15] == 200).all()  # far from everything: untouched
    assert (drawn[30, 5] != 200).any()  # the keypoint
