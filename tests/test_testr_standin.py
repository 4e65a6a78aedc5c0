"""The TESTR stand-in in third_party/testr: builds from its YAMLs, infers, keeps TESTR's state-dict layout.

The compiled attention op is provided by the test-only shim in tests/testr_c_shim.py.
"""
import io
import os
import subprocess
import sys

import pytest
import torch

import testr_c_shim

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "third_party", "testr",
                       "configs")

# Read from TESTR's TransformerDetector built from TotalText/TESTR_R_50_Polygon.yaml: its state dict has 791
# entries holding 50,381,245 numbers; a sample of (name, shape), in state-dict order.
TESTR_R50_POLYGON_STATE_DICT_LEN = 791
TESTR_R50_POLYGON_NUMEL = 50381245
TESTR_R50_POLYGON_SAMPLE = [
    ("testr.backbone.0.backbone.stem.conv1.weight", [64, 3, 7, 7]),
    ("testr.backbone.0.backbone.res2.0.conv3.norm.running_mean", [256]),
    ("testr.backbone.0.backbone.res3.0.conv2.norm.running_var", [128]),
    ("testr.backbone.0.backbone.res3.3.conv3.weight", [512, 128, 1, 1]),
    ("testr.backbone.0.backbone.res4.5.conv2.norm.bias", [256]),
    ("testr.backbone.0.backbone.res5.0.conv3.weight", [2048, 512, 1, 1]),
    ("testr.text_pos_embed.inv_freq", [128]),
    ("testr.transformer.level_embed", [4, 256]),
    ("testr.transformer.encoder.layers.2.self_attn.sampling_offsets.weight", [256, 256]),
    ("testr.transformer.encoder.layers.3.self_attn.output_proj.bias", [256]),
    ("testr.transformer.encoder.layers.4.norm2.weight", [256]),
    ("testr.transformer.decoder.layers.0.attn_cross.value_proj.bias", [256]),
    ("testr.transformer.decoder.layers.0.attn_intra_text.in_proj_weight", [768, 256]),
    ("testr.transformer.decoder.layers.0.linear1_text.bias", [1024]),
    ("testr.transformer.decoder.layers.1.attn_inter.out_proj.weight", [256, 256]),
    ("testr.transformer.decoder.layers.1.attn_cross_text.sampling_offsets.bias", [256]),
    ("testr.transformer.decoder.layers.2.norm_cross.weight", [256]),
    ("testr.transformer.decoder.layers.3.attn_cross_text.value_proj.weight", [256, 256]),
    ("testr.transformer.decoder.layers.4.attn_intra.in_proj_bias", [768]),
    ("testr.transformer.decoder.layers.5.attn_cross.attention_weights.weight", [128, 256]),
    ("testr.transformer.decoder.layers.5.linear2.weight", [256, 1024]),
    ("testr.transformer.decoder.layers.5.norm3_text.bias", [256]),
    ("testr.transformer.enc_output.weight", [256, 256]),
    ("testr.transformer.pos_trans_norm.bias", [256]),
    ("testr.transformer.bbox_class_embed.weight", [1, 256]),
    ("testr.transformer.bbox_embed.layers.2.weight", [4, 256]),
    ("testr.ctrl_point_class.5.bias", [1]),
    ("testr.ctrl_point_coord.5.layers.1.weight", [256, 256]),
    ("testr.bbox_coord.layers.2.bias", [4]),
    ("testr.bbox_class.weight", [1, 256]),
    ("testr.text_class.weight", [97, 256]),
    ("testr.ctrl_point_embed.weight", [16, 256]),
    ("testr.text_embed.weight", [25, 256]),
    ("testr.input_proj.0.0.weight", [256, 512, 1, 1]),
    ("testr.input_proj.2.1.bias", [256]),
    ("testr.input_proj.3.0.weight", [256, 2048, 3, 3]),
    ("testr.input_proj.3.1.bias", [256]),
]


@pytest.fixture(scope="module")
def testr_pkg():
    torch.set_num_threads(1)
    testr_c_shim.install()  # a no-op where d2export's hook already provides testr._C
    import testr
    return testr


def make_cfg(config="tiny.yaml", **overrides):
    from testr.config import get_cfg

    cfg = get_cfg()
    cfg.merge_from_file(os.path.join(CONFIGS, config))
    cfg.MODEL.DEVICE = "cpu"
    for key, value in overrides.items():
        node = cfg
        *path, leaf = key.split(".")
        for part in path:
            node = node[part]
        node[leaf] = value
    return cfg


def build(cfg, seed=0):
    from detectron2.modeling import build_model

    torch.manual_seed(seed)
    return build_model(cfg).eval()


def image(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, h, w), generator=g).float()


def check_instances(inst, h, w, num, n_ctrl=16, n_chars=25, voc=96, field="polygons"):
    assert len(inst) == num
    assert inst.image_size == (h, w)
    assert inst.scores.shape == (num,) and inst.scores.dtype == torch.float32
    assert ((inst.scores >= 0) & (inst.scores <= 1)).all()
    assert inst.pred_classes.shape == (num,) and (inst.pred_classes == 0).all()
    assert inst.rec_scores.shape == (num, n_chars, voc + 1)
    torch.testing.assert_close(inst.rec_scores.sum(-1), torch.ones(num, n_chars))
    assert inst.recs.shape == (num, n_chars) and inst.recs.dtype == torch.int64
    assert ((inst.recs >= 0) & (inst.recs <= voc)).all()
    points = inst.get(field)
    assert points.shape == (num, 2 * n_ctrl)
    assert torch.isfinite(points).all()
    return points


# ---- the test shim itself, against a float64 bilinear reference ---------------------------------------------
def bilinear_reference(value, shapes, locations, weights):
    """Sample-by-sample bilinear interpolation in float64 (align_corners=False, zeros outside)."""
    value, locations, weights = value.double(), locations.double(), weights.double()
    n, _, m, d = value.shape
    _, lq, _, levels, p, _ = locations.shape
    out = torch.zeros(n, lq, m, d, dtype=torch.float64)
    start = 0
    for lvl, (h, w) in enumerate(shapes):
        v = value[:, start:start + h * w].view(n, h, w, m, d)
        start += h * w
        x = locations[..., lvl, :, 0] * w - 0.5  # (n, lq, m, p)
        y = locations[..., lvl, :, 1] * h - 0.5
        x0, y0 = x.floor(), y.floor()
        for dx in (0, 1):
            for dy in (0, 1):
                xi, yi = x0 + dx, y0 + dy
                corner_w = (1 - (x - xi).abs()) * (1 - (y - yi).abs())
                inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
                xc, yc = xi.clamp(0, w - 1).long(), yi.clamp(0, h - 1).long()
                b = torch.arange(n)[:, None, None, None]
                head = torch.arange(m)[None, None, :, None]
                sampled = v[b, yc, xc, head]  # (n, lq, m, p, d)
                coef = corner_w * inside * weights[..., lvl, :]
                out += (sampled * coef[..., None]).sum(3)
    return out.view(n, lq, m * d)


def random_msda_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 9), (3, 5), (2, 2)]  # non-square levels
    n, m, d, lq, p = 2, 2, 4, 7, 3
    value = torch.randn(n, sum(h * w for h, w in shapes), m, d, generator=g)
    # locations reach well outside [0, 1] to exercise the zero padding
    locations = torch.rand(n, lq, m, len(shapes), p, 2, generator=g) * 1.6 - 0.3
    weights = torch.rand(n, lq, m, len(shapes), p, generator=g)
    return value, shapes, locations, weights


def test_shim_matches_float64_reference():
    value, shapes, locations, weights = random_msda_inputs()
    spatial = torch.as_tensor(shapes, dtype=torch.long)
    start = torch.cat((spatial.new_zeros(1), spatial.prod(1).cumsum(0)[:-1]))
    got = testr_c_shim.ms_deform_attn_forward(value, spatial, start, locations, weights, 64)
    torch.testing.assert_close(got.double(), bilinear_reference(value, shapes, locations, weights),
                               atol=1e-5, rtol=1e-5)


def test_pytorch_core_matches_float64_reference(testr_pkg):
    from testr.layers.ms_deform_attn import ms_deform_attn_core_pytorch

    value, shapes, locations, weights = random_msda_inputs(seed=1)
    got = ms_deform_attn_core_pytorch(value, torch.as_tensor(shapes), locations, weights)
    torch.testing.assert_close(got.double(), bilinear_reference(value, shapes, locations, weights),
                               atol=1e-5, rtol=1e-5)


# ---- TESTR's habits that the plugin must cope with ----------------------------------------------------------
def test_import_needs_the_compiled_op():
    """Like `from adet import _C`: without something providing testr._C the package does not import."""
    third_party = os.path.join(os.path.dirname(CONFIGS), os.pardir)
    proc = subprocess.run([sys.executable, "-c", "import testr"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.abspath(third_party)}, timeout=120)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "_C" in proc.stderr


def test_registered_under_testr_meta_architecture(testr_pkg):
    from detectron2.modeling import META_ARCH_REGISTRY

    assert META_ARCH_REGISTRY.get("TransformerDetector") is testr_pkg.modeling.TransformerDetector


# ---- the full-size model keeps TESTR's parameter names and shapes -------------------------------------------
def test_r50_polygon_state_dict_matches_testr(testr_pkg):
    cfg = make_cfg("TotalText/TESTR_R_50_Polygon.yaml")
    assert cfg.MODEL.TRANSFORMER.NUM_CTRL_POINTS == 16 and cfg.MODEL.TRANSFORMER.USE_POLYGON
    assert cfg.INPUT.MIN_SIZE_TEST == 1600 and cfg.MODEL.RESNETS.OUT_FEATURES == ["res3", "res4", "res5"]
    sd = build(cfg).state_dict()
    assert len(sd) == TESTR_R50_POLYGON_STATE_DICT_LEN
    assert sum(v.numel() for v in sd.values()) == TESTR_R50_POLYGON_NUMEL
    assert all(v.dtype == torch.float32 for v in sd.values())
    names = list(sd)
    assert names[0] == TESTR_R50_POLYGON_SAMPLE[0][0] and names[-1] == TESTR_R50_POLYGON_SAMPLE[-1][0]
    for name, shape in TESTR_R50_POLYGON_SAMPLE:
        assert name in sd, name
        assert list(sd[name].shape) == shape, name
    positions = [names.index(name) for name, _ in TESTR_R50_POLYGON_SAMPLE]
    assert positions == sorted(positions)


# ---- the tiny model: inference -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(testr_pkg):
    return build(make_cfg())


@pytest.mark.parametrize("h, w", [(128, 128), (96, 160), (176, 112)])
def test_tiny_inference_single_image(tiny, h, w):
    with torch.no_grad():
        (out,) = tiny([{"image": image(h, w, seed=h + w)}])
    points = check_instances(out["instances"], h, w, num=10)
    # polygons: sigmoid outputs scaled to the image
    assert (points[:, 0::2] >= 0).all() and (points[:, 0::2] <= w).all()
    assert (points[:, 1::2] >= 0).all() and (points[:, 1::2] <= h).all()


def test_tiny_inference_batch_of_two_sizes(tiny):
    sizes = [(128, 96), (80, 144)]
    with torch.no_grad():
        outs = tiny([{"image": image(h, w, seed=i)} for i, (h, w) in enumerate(sizes)])
    assert len(outs) == 2
    for out, (h, w) in zip(outs, sizes):
        points = check_instances(out["instances"], h, w, num=10)
        assert (points[:, 0::2] <= w).all() and (points[:, 1::2] <= h).all()


def test_tiny_rescales_to_requested_output_size(tiny):
    img = image(96, 128, seed=3)
    with torch.no_grad():
        base = tiny([{"image": img}])[0]["instances"]
        scaled = tiny([{"image": img, "height": 192, "width": 384}])[0]["instances"]
    torch.testing.assert_close(scaled.polygons[:, 0::2], base.polygons[:, 0::2] * 3)
    torch.testing.assert_close(scaled.polygons[:, 1::2], base.polygons[:, 1::2] * 2)
    torch.testing.assert_close(scaled.scores, base.scores)


def test_tiny_threshold_selects_results(testr_pkg, tiny):
    img = image(112, 112, seed=4)
    with torch.no_grad():
        every = tiny([{"image": img}])[0]["instances"]
        th = every.scores.median().item()
        selective = build(make_cfg(**{"MODEL.TRANSFORMER.INFERENCE_TH_TEST": th}))
        kept = selective([{"image": img}])[0]["instances"]
        none = build(make_cfg(**{"MODEL.TRANSFORMER.INFERENCE_TH_TEST": 1.01}))([{"image": img}])[0]["instances"]
    expected = every.scores >= th
    check_instances(kept, 112, 112, num=int(expected.sum()))
    torch.testing.assert_close(kept.scores, every.scores[expected])
    torch.testing.assert_close(kept.polygons, every.polygons[expected])
    check_instances(none, 112, 112, num=0)


def test_tiny_bezier_variant(testr_pkg):
    cfg = make_cfg(**{"MODEL.TRANSFORMER.USE_POLYGON": False, "MODEL.TRANSFORMER.NUM_CTRL_POINTS": 8})
    h, w = 96, 128
    with torch.no_grad():
        (out,) = build(cfg)([{"image": image(h, w, seed=5)}])
    inst = out["instances"]
    assert not inst.has("polygons")
    beziers = check_instances(inst, h, w, num=10, n_ctrl=8, field="beziers")
    # the curves' end points are clipped to the image; inner control points may leave it
    for x_col in (0, 6, 8, 14):
        assert (beziers[:, x_col] >= 0).all() and (beziers[:, x_col] <= w).all()
        assert (beziers[:, x_col + 1] >= 0).all() and (beziers[:, x_col + 1] <= h).all()


# ---- weights -------------------------------------------------------------------------------------------------
def test_tiny_state_dict_reloads_strictly(testr_pkg, tiny):
    buf = io.BytesIO()
    torch.save(tiny.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    other = build(make_cfg(), seed=123)
    img = [{"image": image(96, 96, seed=6)}]
    with torch.no_grad():
        before = other(img)[0]["instances"]
        assert other.load_state_dict(state, strict=True)
        after = other(img)[0]["instances"]
        expected = tiny(img)[0]["instances"]
    assert not torch.allclose(before.polygons, expected.polygons)
    torch.testing.assert_close(after.polygons, expected.polygons)
    torch.testing.assert_close(after.rec_scores, expected.rec_scores)

    state["testr.renamed.weight"] = state.pop("testr.text_class.weight")
    with pytest.raises(RuntimeError):
        other.load_state_dict(state, strict=True)
