"""DPText-DETR and DeepSolo beside TESTR: the stand-ins (third_party/dptext, third_party/deepsolo) keep upstream's
state dicts, the AdelaiDet rewrites are exact on their code, their tiny configs export and verify, and the served
graph answers as the eager models' own inference() does."""
from __future__ import annotations

import importlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from d2export import families
from upstream_reading import ASCII, LOWER_ALNUM, deepsolo_reading
from d2export.ops import detr_sizes
from d2export.patching import compiled_ops

compiled_ops.install(["testr._C", "dptext._C", "deepsolo._C"])

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
SIZES = [[(37, 53), (40, 40)], [(64, 24)], [(17, 90), (90, 17), (50, 51)]]


@dataclass
class Spec:
    package: str
    r50: str  # the released Total-Text R-50 config, in the stand-in
    keys: str  # upstream's state-dict listing (read from the unedited model)
    config: str  # the tiny d2export config
    head: str
    outputs: tuple


SPECS = {
    "dptext": Spec("dptext", "configs/DPText_DETR/TotalText/R_50_poly.yaml", "dptext_state_dict.txt", "dptext_tiny",
                   "dptext_detr", ("scores", "labels", "ctrl_points")),
    "deepsolo": Spec("deepsolo", "configs/R_50/TotalText/finetune_150k_tt.yaml", "deepsolo_state_dict.txt",
                     "deepsolo_tiny", "detection_transformer",
                     ("scores", "labels", "ctrl_points", "char_ids", "char_scores", "bd_points")),
}


def build(name: str, config: str, seed: int = 0):
    from detectron2.modeling import build_model

    cfg = importlib.import_module(f"{name}.config").get_cfg()
    cfg.merge_from_file(str(REPO / "third_party" / name / config))
    cfg.MODEL.DEVICE = "cpu"
    torch.manual_seed(seed)
    return cfg, build_model(cfg).eval()


def upstream_keys(spec: Spec) -> list[tuple[str, tuple]]:
    rows = [line.rstrip("\n").split("\t") for line in (DATA / spec.keys).read_text().splitlines()
            if line and not line.startswith("#")]
    return [(key, tuple(int(d) for d in shape.strip("()").split(",") if d.strip())) for key, shape, _ in rows]


# ------------------------------------------------------------------------------------------------ weights
@pytest.mark.parametrize("name", SPECS)
def test_a_checkpoint_with_upstreams_keys_loads_strictly(name):
    """A checkpoint written from upstream's key list (names, shapes, order; random values) loads with strict=True
    into the stand-in's R-50 Total-Text model, every value where it belongs."""
    spec = SPECS[name]
    keys = upstream_keys(spec)
    _, model = build(name, spec.r50)
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == keys
    g = torch.Generator().manual_seed(7)
    checkpoint = {k: (torch.randint(0, 9, shape, generator=g) if k.endswith("num_batches_tracked")
                      else torch.randn(shape, generator=g)) for k, shape in keys}
    model.load_state_dict(checkpoint, strict=True)
    loaded = model.state_dict()
    for k in (keys[0][0], keys[len(keys) // 2][0], keys[-1][0]):
        assert torch.equal(loaded[k], checkpoint[k]), k
    del checkpoint[keys[-1][0]]
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(checkpoint, strict=True)


# -------------------------------------------------------------------------------- size-general rewrites
def flat_inputs(image_sizes, strides=(8, 16, 32), c=256):
    """Padding masks of a padded batch (upstream's own mask_out_padding), flattened as the transformers do."""
    from testr.modeling.transformer_detector import MaskedBackbone

    wrapper = MaskedBackbone.__new__(MaskedBackbone)
    wrapper.feature_strides = list(strides)
    hmax, wmax = max(h for h, _ in image_sizes), max(w for _, w in image_sizes)
    shapes = [(len(image_sizes), 1, -(-hmax // s), -(-wmax // s)) for s in strides]
    masks = [m.bool() for m in MaskedBackbone.mask_out_padding(wrapper, shapes, image_sizes, "cpu")]
    spatial = torch.tensor([m.shape[1:] for m in masks])
    mask_flat = torch.cat([m.flatten(1) for m in masks], 1)
    memory = torch.randn(len(image_sizes), mask_flat.shape[1], c, generator=torch.Generator().manual_seed(1))
    return spatial, mask_flat, memory


def dptext_transformer():
    from dptext.layers.deformable_transformer import DeformableTransformer_Det

    return DeformableTransformer_Det(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                                     num_feature_levels=3, num_proposals=5, epqm=True, efsa=True)


def deepsolo_transformer():
    from deepsolo.layers.deformable_transformer import DeformableTransformer
    from deepsolo.modeling.model.utils import MLP

    t = DeformableTransformer(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, num_feature_levels=3,
                              num_proposals=5)
    t.bezier_coord_embed, t.bezier_class_embed = MLP(256, 256, 8, 3), torch.nn.Linear(256, 1)
    return t


@pytest.mark.parametrize("image_sizes", SIZES)
@pytest.mark.parametrize("make", [dptext_transformer, deepsolo_transformer], ids=["dptext", "deepsolo"])
def test_encoder_proposals_rewrite_equals_each_original(make, image_sizes):
    """DPText-DETR proposes boxes, DeepSolo cubic Beziers shrunk to the cell centre: the one rewrite gives each
    model's own proposals, bit for bit, at odd and mixed sizes."""
    spatial, mask_flat, memory = flat_inputs(image_sizes)
    torch.manual_seed(0)
    transformer = make().eval()
    expected = transformer.gen_encoder_output_proposals(memory, mask_flat, spatial)
    got = detr_sizes.gen_encoder_output_proposals(transformer, memory, mask_flat, spatial)
    assert got[1].shape[-1] == (8 if make is deepsolo_transformer else 4)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", SPECS)
def test_the_other_rewrites_reach_both_models(name):
    """The padding-mask and reference-point rewrites are matched by duck typing (their exactness against this same
    code: tests/test_adet_family.py); each model has exactly the modules they are written for."""
    from d2export.patching import msda_swap

    spec = SPECS[name]
    _, model = build(name, "configs/tiny.yaml")
    modules = list(model.modules())
    assert sum(map(detr_sizes.has_mask_out_padding, modules)) == 1
    assert sum(map(detr_sizes.has_reference_points, modules)) == 1
    assert sum(map(detr_sizes.has_encoder_proposals, modules)) == 1
    assert sum(map(msda_swap.is_msda, modules)) == 2  # tiny: one encoder and one decoder layer
    head = importlib.import_module(f"d2export.families.{name}").HEAD
    assert families.recognise(model).name == name and families.find_child(model, head)[0] == spec.head


# ------------------------------------------------------------------------------------------ recognition
@pytest.fixture(scope="module")
def testr_model():
    import testr.config
    from detectron2.modeling import build_model

    cfg = testr.config.get_cfg()
    cfg.merge_from_file(str(REPO / "third_party" / "testr" / "configs" / "tiny.yaml"))
    return build_model(cfg).eval()


def test_dptext_family_on_a_testr_model_names_what_it_lacked(testr_model):
    with pytest.raises(families.FamilyError) as e:
        families.recognise(testr_model, "dptext")
    message = str(e.value)
    assert "\n" not in message and "not a model of family 'dptext'" in message
    assert "init_control_points_from_anchor" in message and "'testr'" in message
    with pytest.raises(families.FamilyError, match="init_points_from_bezier_proposals"):
        families.recognise(testr_model, "deepsolo")
    assert families.recognise(testr_model).name == "testr"


# ---------------------------------------------------------------------------------------- text decoding
def upstream_ctc_text(ids, voc_size=37) -> str:
    """DeepSolo's own reading for its built-in sets (tests/upstream_reading.py)."""
    return deepsolo_reading(ids, LOWER_ALNUM if voc_size == 37 else ASCII)


@pytest.mark.parametrize("voc_size", [37, 96])
def test_deepsolo_charset_and_ctc_reading_follow_upstream(voc_size):
    from d2export.charset import decode
    from deepsolo.config import get_cfg

    cfg = get_cfg()
    cfg.MODEL.TRANSFORMER.VOC_SIZE = voc_size
    post = families.get("deepsolo").postprocess(cfg) | families.get("deepsolo").text_charset(cfg)
    assert post["voc_size"] == voc_size and post["text_decoding"] == "ctc" and len(post["charset"]) == voc_size - 1
    rng = np.random.default_rng(voc_size)
    for _ in range(50):
        ids = rng.integers(0, voc_size + 1, 25)
        ids[rng.integers(0, 25, 8)] = ids[0]  # repeats, also across separators
        assert decode(ids.tolist(), list(post["charset"]), ctc=True) == upstream_ctc_text(ids.tolist(), voc_size)


def test_deepsolo_custom_dict_is_honoured(tmp_path):
    from deepsolo.config import get_cfg

    path = tmp_path / "chars"
    path.write_bytes(pickle.dumps([0x4E2D, 0x6587, 0x5B57, 0x7B26]))
    cfg = get_cfg()
    cfg.MODEL.TRANSFORMER.VOC_SIZE = 5
    cfg.MODEL.BATEXT.CUSTOM_DICT = str(path)
    assert families.get("deepsolo").text_charset(cfg)["charset"] == "中文字符"


# ----------------------------------------------------------------------------------- export and serving
@pytest.fixture(scope="module", params=list(SPECS))
def spotter(request, tmp_path_factory):
    """(name, config, manifest, model path) of the tiny config exported with the default pipeline (verified)."""
    from d2export import pipeline
    from d2export.config import load

    spec = SPECS[request.param]
    out = tmp_path_factory.mktemp(spec.config)
    cfg = load(spec.config, [f"export.output_dir={out}"])
    manifest = pipeline.export(cfg)
    return request.param, cfg, manifest, out / manifest.model_file


def test_tiny_export_verifies_at_five_sizes_and_a_mixed_batch(spotter):
    name, cfg, manifest, _ = spotter
    spec = SPECS[name]
    assert manifest.family == name
    assert tuple(t.name for t in manifest.outputs) == spec.outputs
    points = 16 if name == "dptext" else 25
    assert manifest.outputs[2].shape == ["batch", 10, points, 2]
    v = manifest.verification
    assert v["passed"] is True and v["lint"]["clean"] is True and not v["lint"]["size_dependent_constants"]
    cases = {c["case"] for c in v["cases"]}
    h, w = cfg.export.dummy_sizes[0]
    assert len(cases) == 6 and {f"{h}x{w}", f"{w}x{h}"} <= cases and any(c.startswith("batch ") for c in cases)
    by_name = {p["name"]: p for p in manifest.patches}
    assert by_name["msda-core"]["sites"] == 2
    for patch in ("sizes-as-tensor", "padding-mask-from-sizes", "reference-points-per-level",
                  "encoder-proposals-per-level"):
        assert by_name[patch]["hits"] > 0, patch
    if name == "deepsolo":
        assert manifest.postprocess["points"] == "centre_line" and len(manifest.postprocess["charset"]) == 36
    else:
        assert manifest.postprocess["points"] == "polygon" and "charset" not in manifest.postprocess


@pytest.fixture(scope="module")
def served(spotter):
    from d2export import pipeline
    from d2export.runtime.predictor import Predictor

    name, cfg, manifest, model_path = spotter
    return name, manifest, Predictor(model_path, threads=1), pipeline.prepare(cfg).model.eval()


def originals(sizes, seed=0):
    from d2export.resizing import synthetic_image

    return [synthetic_image(h, w, seed + i).transpose(1, 2, 0).copy() for i, (h, w) in enumerate(sizes)]


@torch.no_grad()
def eager_instances(model, manifest, images):
    """DefaultPredictor's way through the model's own forward and inference(): resize, height/width = original."""
    from detectron2.data import transforms as T

    pre = manifest.preprocess
    aug = T.ResizeShortestEdge([pre["min_size_test"]] * 2, pre["max_size_test"])
    inputs = []
    for image in images:
        resized = aug.get_transform(image).apply_image(image)
        inputs.append({"image": torch.as_tensor(resized.transpose(2, 0, 1).astype(np.float32)),
                       "height": image.shape[0], "width": image.shape[1]})
    return [out["instances"] for out in model(inputs)]


def test_predictor_matches_the_eager_models_inference(served):
    """One picture and a batch of mixed sizes: the served graph + the family's serving post-processing give what
    upstream's inference() and detector_postprocess give (scores, points, boundaries, text)."""
    name, manifest, predictor, model = served
    for images in (originals([(120, 200)]), originals([(300, 180), (90, 400)], seed=5)):
        for pred, inst, image in zip(predictor.predict_batch(images), eager_instances(model, manifest, images),
                                     images):
            assert (pred.height, pred.width) == image.shape[:2]
            assert len(pred.instances) == len(inst) == 10
            np.testing.assert_allclose([i.score for i in pred.instances], inst.scores.double(), atol=1e-5, rtol=1e-4)
            assert [i.label for i in pred.instances] == inst.pred_classes.tolist()
            lines = np.array([np.ravel(i.polygon) for i in pred.instances])
            if name == "dptext":
                assert all(i.closed and i.text is None and i.boundary is None for i in pred.instances)
                np.testing.assert_allclose(lines, inst.polygons.double(), atol=5e-3, rtol=1e-4)
                continue
            assert not any(i.closed for i in pred.instances)
            np.testing.assert_allclose(lines, inst.ctrl_points.double(), atol=5e-3, rtol=1e-4)
            # upstream draws the boundary as the upper points, then the lower ones reversed
            bd = inst.bd.double().numpy()
            outline = np.concatenate([bd[:, :, :2], bd[:, ::-1, 2:]], axis=1)
            np.testing.assert_allclose([i.boundary for i in pred.instances], outline, atol=5e-3, rtol=1e-4)
            top2 = inst.rec_scores.topk(2, dim=-1).values
            clear = ((top2[..., 0] - top2[..., 1]).min(-1).values > 1e-4).numpy()
            assert clear.sum() >= len(inst) // 2
            for k in np.flatnonzero(clear):
                assert pred.instances[k].text == upstream_ctc_text(inst.recs[k].tolist())


def test_infer_draws_pictures_and_the_server_describes_the_schema(served, tmp_path):
    import httpx
    from PIL import Image

    from d2export.cli import main
    from d2export.runtime.server import create_app, serving

    name, manifest, predictor, _ = served
    picture = tmp_path / "one.png"
    Image.fromarray(originals([(130, 210)], seed=3)[0]).save(picture)
    out, vis = tmp_path / "out.jsonl", tmp_path / "vis"
    assert main(["infer", str(predictor.model_path), str(picture), "-o", str(out), "--vis", str(vis),
                 "--threads", "1", "--no-progress"]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    fields = {"score", "label", "polygon"} | ({"closed", "boundary", "text", "text_score"} if name == "deepsolo"
                                              else set())
    assert set(record["instances"][0]) == fields
    with Image.open(vis / "one.png") as drawn, Image.open(picture) as original:
        assert drawn.size == original.size
        assert not np.array_equal(np.asarray(drawn.convert("RGB")), np.asarray(original.convert("RGB")))
    with serving(create_app(predictor)) as url, httpx.Client(base_url=url, timeout=30) as client:
        meta = client.get("/metadata").json()
        assert meta["family"] == name
        assert [t["name"] for t in meta["outputs"]] == list(SPECS[name].outputs)
        assert meta["postprocess"] == manifest.postprocess
        got = client.post("/predict", content=picture.read_bytes()).json()
        assert len(got["instances"]) == len(record["instances"])
