"""The Mask2Former stand-in in third_party/mask2former: imports only with the compiled ops stood in for, builds from
its YAMLs (upstream's keys), keeps Mask2Former's state-dict layout, and its eager forward gives the three outputs
with real masked attention."""
import os
import subprocess
import sys

import pytest
import torch

from d2export.patching import compiled_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "third_party", "mask2former")
CONFIGS = os.path.join(STANDIN, "configs")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)

# Read from upstream Mask2Former's MaskFormer built from coco/panoptic-segmentation/maskformer2_R50_bs16_50ep.yaml:
# 558 state-dict entries holding 44,090,252 numbers (criterion.empty_weight included); a sample, in order.
R50_PANOPTIC_STATE_DICT_LEN = 558
R50_PANOPTIC_NUMEL = 44090252
R50_PANOPTIC_SAMPLE = [
    ("backbone.stem.conv1.weight", [64, 3, 7, 7]),
    ("backbone.res5.2.conv3.norm.running_var", [2048]),
    ("sem_seg_head.pixel_decoder.input_proj.0.0.weight", [256, 2048, 1, 1]),
    ("sem_seg_head.pixel_decoder.input_proj.2.1.bias", [256]),
    ("sem_seg_head.pixel_decoder.transformer.level_embed", [3, 256]),
    ("sem_seg_head.pixel_decoder.transformer.encoder.layers.0.linear1.weight", [1024, 256]),
    ("sem_seg_head.pixel_decoder.transformer.encoder.layers.5.self_attn.sampling_offsets.weight", [192, 256]),
    ("sem_seg_head.pixel_decoder.transformer.encoder.layers.5.self_attn.attention_weights.bias", [96]),
    ("sem_seg_head.pixel_decoder.mask_features.weight", [256, 256, 1, 1]),
    ("sem_seg_head.pixel_decoder.adapter_1.weight", [256, 256, 1, 1]),
    ("sem_seg_head.pixel_decoder.layer_1.norm.weight", [256]),
    ("sem_seg_head.predictor.transformer_self_attention_layers.8.self_attn.in_proj_weight", [768, 256]),
    ("sem_seg_head.predictor.transformer_cross_attention_layers.0.multihead_attn.out_proj.weight", [256, 256]),
    ("sem_seg_head.predictor.transformer_ffn_layers.8.linear1.weight", [2048, 256]),
    ("sem_seg_head.predictor.decoder_norm.weight", [256]),
    ("sem_seg_head.predictor.query_feat.weight", [100, 256]),
    ("sem_seg_head.predictor.query_embed.weight", [100, 256]),
    ("sem_seg_head.predictor.level_embed.weight", [3, 256]),
    ("sem_seg_head.predictor.class_embed.weight", [134, 256]),
    ("sem_seg_head.predictor.mask_embed.layers.2.bias", [256]),
    ("criterion.empty_weight", [134]),
]

TINY = {"panoptic": 133, "instance": 80, "semantic": 150}
SIZES = [(64, 96), (128, 160)]  # two non-square pictures in one batch (padded to 128x160)


@pytest.fixture(scope="module")
def m2f():
    """`mask2former`, imported with MultiScaleDeformableAttention stood in for (as the plugin does) and detectron2's
    `_C` stood in for during the import only. detectron2.evaluation is imported first, so that its COCOEvaluator
    settles on the plain COCOeval while `_C` is absent, and `_C` is importable for no longer than this import."""
    import detectron2
    import detectron2.evaluation.coco_evaluation  # noqa: F401

    finder = compiled_ops.install(["MultiScaleDeformableAttention"])
    added = "detectron2._C" not in finder.names
    finder.names.add("detectron2._C")
    try:
        import mask2former
    finally:
        if added:
            finder.names.discard("detectron2._C")
            if getattr(sys.modules.get("detectron2._C"), "__d2export_stand_in__", False):
                del sys.modules["detectron2._C"]
                if hasattr(detectron2, "_C"):
                    delattr(detectron2, "_C")
    return mask2former


def _cfg(m2f, path):
    from detectron2.config import get_cfg
    from detectron2.projects.deeplab import add_deeplab_config

    cfg = get_cfg()
    add_deeplab_config(cfg)
    m2f.add_maskformer2_config(cfg)
    cfg.merge_from_file(os.path.join(CONFIGS, path))
    cfg.MODEL.DEVICE = "cpu"
    return cfg


def _build(m2f, path, seed=1):
    from detectron2.modeling import build_model

    # random weights: with this seed every decoder layer of the tiny models masks part of its level, and the tiny
    # panoptic model keeps a segment per picture of _batch()
    torch.manual_seed(seed)
    return build_model(_cfg(m2f, path)).eval()


@pytest.fixture(scope="module")
def tiny(m2f):
    """The tiny models, each built once."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = _build(m2f, f"tiny/{name}.yaml")
        return built[name]

    return get


def _batch(out_sizes=((64, 96), (100, 120))):
    g = torch.Generator().manual_seed(3)
    return [{"image": torch.rand(3, h, w, generator=g) * 255, "height": oh, "width": ow}
            for (h, w), (oh, ow) in zip(SIZES, out_sizes)]


def test_unbuilt_ops_make_the_import_fail():
    """Fresh, without the plugin: `import mask2former` fails on the MSDA extension (ms_deform_attn_func.py). With
    that stood in for, it fails next on detectron2's `_C` (the evaluator's fast_eval_api), as upstream does. Each in
    a process of its own: a failed import has registered the backbone already, as upstream's does."""
    first = "try:\n    import mask2former\nexcept ModuleNotFoundError as e:\n    print('FAILED', e)\n"
    second = ("from d2export.patching import compiled_ops\n"
              "compiled_ops.install(['MultiScaleDeformableAttention'])\n"
              "try:\n    import mask2former\nexcept ImportError as e:\n    print('FAILED', e)\n")
    said = []
    for script in (first, second):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": STANDIN})
        assert proc.returncode == 0, proc.stderr
        said.append(proc.stdout)
    assert "FAILED" in said[0] and "MultiScaleDeformableAttention" in said[0]
    assert "FAILED" in said[1] and "_C" in said[1] and "detectron2" in said[1]


def test_registered_and_configured_as_upstream(m2f):
    from detectron2.modeling import META_ARCH_REGISTRY, SEM_SEG_HEADS_REGISTRY
    from mask2former.modeling.transformer_decoder.maskformer_transformer_decoder import TRANSFORMER_DECODER_REGISTRY

    assert META_ARCH_REGISTRY.get("MaskFormer") is m2f.MaskFormer
    assert SEM_SEG_HEADS_REGISTRY.get("MaskFormerHead") is m2f.modeling.MaskFormerHead
    assert SEM_SEG_HEADS_REGISTRY.get("MSDeformAttnPixelDecoder") is m2f.modeling.MSDeformAttnPixelDecoder
    assert TRANSFORMER_DECODER_REGISTRY.get("MultiScaleMaskedTransformerDecoder")
    flags = {"coco/panoptic-segmentation/maskformer2_R50_bs16_50ep.yaml": (True, True, True, 133),
             "coco/instance-segmentation/maskformer2_R50_bs16_50ep.yaml": (False, True, False, 80),
             "ade20k/semantic-segmentation/maskformer2_R50_bs16_160k.yaml": (True, False, False, 150)}
    for path, (sem, inst, pan, k) in flags.items():
        cfg = _cfg(m2f, path)
        t = cfg.MODEL.MASK_FORMER.TEST
        assert (t.SEMANTIC_ON, t.INSTANCE_ON, t.PANOPTIC_ON, cfg.MODEL.SEM_SEG_HEAD.NUM_CLASSES) == (sem, inst, pan, k)
        assert cfg.MODEL.MASK_FORMER.DEC_LAYERS == 10 and cfg.MODEL.SEM_SEG_HEAD.TRANSFORMER_ENC_LAYERS == 6
        assert cfg.MODEL.MASK_FORMER.NUM_OBJECT_QUERIES == 100 and cfg.MODEL.RESNETS.DEPTH == 50


def test_full_size_state_dict_is_mask2formers(m2f):
    sd = _build(m2f, "coco/panoptic-segmentation/maskformer2_R50_bs16_50ep.yaml").state_dict()
    assert len(sd) == R50_PANOPTIC_STATE_DICT_LEN
    assert sum(v.numel() for v in sd.values()) == R50_PANOPTIC_NUMEL
    keys = list(sd)
    positions = [keys.index(name) for name, _ in R50_PANOPTIC_SAMPLE]
    assert positions == sorted(positions) and positions[-1] == len(keys) - 1
    assert all(list(sd[name].shape) == shape for name, shape in R50_PANOPTIC_SAMPLE)


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_eval_forward(tiny, name, monkeypatch):
    model = tiny(name)
    k = TINY[name]
    assert model.sem_seg_head.num_classes == k and model.size_divisibility == 32
    assert model.sem_seg_head.predictor.num_layers == 3

    # the deformable attention goes through the compiled op's entry point (the stand-in), not the fallback
    msda = sys.modules["MultiScaleDeformableAttention"]
    calls = []
    forward = msda.ms_deform_attn_forward
    monkeypatch.setattr(msda, "ms_deform_attn_forward", lambda *a: calls.append(1) or forward(*a))

    out_sizes = [(64, 96), (100, 120)]
    with torch.no_grad():
        results = model(_batch(out_sizes))
    assert len(calls) == 2  # two encoder layers, the batch at once

    assert len(results) == 2
    test = model
    expected = {key for key, on in (("sem_seg", test.semantic_on), ("panoptic_seg", test.panoptic_on),
                                    ("instances", test.instance_on)) if on}
    for r, (h, w) in zip(results, out_sizes):
        assert set(r) == expected
        if test.semantic_on:
            assert r["sem_seg"].shape == (k, h, w) and torch.isfinite(r["sem_seg"]).all()
        if test.panoptic_on:
            seg, info = r["panoptic_seg"]
            assert seg.shape == (h, w) and seg.dtype == torch.int32
            assert info, "OBJECT_MASK_THRESHOLD 0 in the tiny config: some segment must survive"
            assert set(seg.unique().tolist()) - {0} == {s["id"] for s in info}
            assert all(0 <= s["category_id"] < k and s["isthing"] == (s["category_id"] < 80) for s in info)
        if test.instance_on:
            inst = r["instances"]
            assert inst.image_size == (h, w)
            assert inst.pred_masks.shape[1:] == (h, w) and inst.pred_masks.dtype == torch.float32
            n = len(inst)
            assert inst.scores.shape == (n,) and inst.pred_classes.shape == (n,)
            if test.panoptic_on:  # things only
                assert 0 < n <= 100 and (inst.pred_classes < 80).all()
            else:
                assert n == 100 and (inst.pred_classes < k).all()


def test_masked_attention_masks(tiny):
    """Each of the 3 decoder layers cross-attends to one pixel-decoder level (coarsest first) under a boolean mask
    from the previous prediction (True: not attended), never masking a whole row; masked keys get no weight."""
    model = tiny("panoptic")
    predictor = model.sem_seg_head.predictor
    seen = []

    def hook(module, args, kwargs, output):
        seen.append((kwargs["attn_mask"].clone(), output[1]))

    handles = [layer.multihead_attn.register_forward_hook(hook, with_kwargs=True)
               for layer in predictor.transformer_cross_attention_layers]
    try:
        with torch.no_grad():
            model(_batch())
    finally:
        for h in handles:
            h.remove()

    heads, queries, n = predictor.num_heads, predictor.num_queries, 2
    level_hw = [(128 // 32) * (160 // 32), (128 // 16) * (160 // 16), (128 // 8) * (160 // 8)]
    assert len(seen) == 3
    for i, (mask, weights) in enumerate(seen):
        assert mask.dtype == torch.bool and mask.shape == (n * heads, queries, level_hw[i])
        assert mask.any() and not mask.all()
        assert not mask.all(-1).any()  # all-masked rows were opened up in place
        # the mask repeats over heads (batch-major), so the head-averaged weights vanish where it is True
        per_image = mask.view(n, heads, queries, -1)
        assert torch.equal(per_image, per_image[:, :1].expand_as(per_image))
        assert weights.shape == (n, queries, level_hw[i])
        assert (weights[per_image[:, 0]] == 0).all() and (weights[~per_image[:, 0]] > 0).any()
