"""Swin backbones exported at any size and batch (d2export/patching/backbones.py, d2export/ops/windows.py).

The reference is upstream's own code: detectron2's `SwinTransformer` (detectron2/modeling/backbone/swin.py, the copy
detrex and ViTDet configs build, line for line the Swin of Mask2Former, OneFormer, MaskDINO and AdelaiDet/DeepSolo),
run eagerly and unpatched. Sizes: whole windows at every stage and none (window 7 at 224, window 12 at 384), a last
stage smaller than one window (64x64), odd sizes at every stage (333x313), a transposed pair with the same window
count, batches of two and three.
"""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from detectron2.modeling.backbone import swin as upstream
from torch import nn

from d2export import pipeline
from d2export.config import load
from d2export.ops import windows
from d2export.patching import apply_patches, backbones

SWIN_PATCHES = ["swin-shift-mask", "swin-window-sizes", "swin-patch-merging", "patch-embed-padding"]
OUTPUTS = ["p0", "p1", "p2", "p3"]
# what onnxruntime's float32 graph may differ from eager float32 by (measured 2-3.2e-6 at every size here, on
# features of unit scale after each stage's LayerNorm); a graph that bakes a size is off by 0.4 or fails
BOUND = 3e-5


def tiny_swin(window: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return upstream.SwinTransformer(embed_dim=32, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=window,
                                    drop_path_rate=0.0).eval()


class Features(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, x):
        return tuple(self.backbone(x).values())


def export(model, only=SWIN_PATCHES, size=(224, 224)) -> ort.InferenceSession:
    """The backbone traced at `size` by the TorchScript-based exporter, batch, height and width dynamic, under the
    patches `only` names (None: none at all)."""
    scope = apply_patches(model=model, only=only) if only is not None else contextlib.nullcontext()
    f = io.BytesIO()
    axes = {"x": {0: "b", 2: "h", 3: "w"}, **{n: {0: "b", 2: f"h{n}", 3: f"w{n}"} for n in OUTPUTS}}
    with scope, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Features(model), (torch.randn(1, 3, *size),), f, input_names=["x"], output_names=OUTPUTS,
                          opset_version=17, dynamo=False, dynamic_axes=axes)
    return ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])


CASES = [(1, 224, 224), (1, 64, 64), (1, 333, 313), (1, 256, 192), (1, 192, 256), (2, 320, 224), (3, 384, 384)]


def worst(session, model, batch, h, w, seed=0) -> float:
    """Largest difference of the graph's four feature maps from upstream's eager ones (inf where the graph fails)."""
    x = torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = [t.numpy() for t in model(x).values()]
    try:
        got = session.run(None, {"x": x.numpy()})
    except Exception:  # noqa: BLE001 - onnxruntime refusing the shapes is the baked graph failing
        return float("inf")
    if any(g.shape != e.shape for g, e in zip(got, want)):
        return float("inf")  # a baked size: maps of the dummy's arithmetic
    return max(float(np.abs(g - e).max()) for g, e in zip(got, want))


# --- the ops against upstream's own ------------------------------------------------------------------------------
def _upstream_mask(window: int, height: int, width: int) -> torch.Tensor:
    """The mask upstream's BasicLayer builds for a height x width map, caught on its way into the first block."""
    stage = upstream.BasicLayer(dim=8, depth=2, num_heads=1, window_size=window).eval()
    seen = []
    stage.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    with torch.no_grad():
        stage(torch.zeros(1, height * width, 8), height, width)
    return seen[0]


@pytest.mark.parametrize("window, height, width", [(7, 14, 21), (7, 9, 3), (12, 24, 12), (12, 30, 41), (7, 2, 2)])
def test_shift_mask_is_upstreams(window, height, width):
    hp, wp = windows.ceil_to(height, window), windows.ceil_to(width, window)
    want = _upstream_mask(window, height, width)
    got = windows.shift_mask(hp, wp, window, window // 2, "cpu")
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert (want == -100).any() and (want == 0).any()


def test_partition_and_reverse_are_upstreams_and_invert():
    x = torch.randn(3, 14, 21, 5)
    parts = windows.partition(x, 7)
    assert torch.equal(parts, upstream.window_partition(x, 7))
    assert torch.equal(windows.reverse(parts, 7, 14, 21), x)
    assert torch.equal(windows.reverse(parts, 7, 14, 21), upstream.window_reverse(parts, 7, 14, 21))


def test_padding_is_f_pad_by_the_exact_amounts():
    x = torch.randn(2, 9, 10, 3)
    assert torch.equal(windows.pad_bottom_right(x, 7), torch.nn.functional.pad(x, (0, 0, 0, 4, 0, 5)))
    image = torch.randn(1, 3, 33, 30)
    assert torch.equal(windows.pad_bottom_right(image, (4, 4), channels_last=False),
                       torch.nn.functional.pad(image, (0, 2, 0, 3)))
    assert torch.equal(windows.pad_bottom_right(image[:, :, :32, :28], 4, channels_last=False), image[:, :, :32, :28])


# --- the patched backbone ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [7, 12])
def test_patched_eager_backbone_returns_upstreams_bits(window):
    """The replacements compute what upstream computes, bit for bit, eagerly: at every case size."""
    model = tiny_swin(window)
    for batch, h, w in CASES:
        x = torch.randn(batch, 3, h, w)
        with torch.no_grad():
            want = model(x)
            with apply_patches(model=model, only=SWIN_PATCHES) as report:
                got = model(x)
        assert all(torch.equal(got[k], want[k]) for k in want), (batch, h, w)
    assert {r.name: r.sites for r in report.records if r.name in SWIN_PATCHES} == {
        "swin-shift-mask": 4, "swin-window-sizes": 8, "swin-patch-merging": 3, "patch-embed-padding": 1}


@pytest.mark.parametrize("window", [7, 12])
def test_exported_backbone_matches_upstream_at_every_size_and_batch(window):
    model = tiny_swin(window)
    session = export(model)
    for case in CASES:
        assert worst(session, model, *case) < BOUND, case


def test_unpatched_upstream_swin_does_not_even_export():
    """As users report (window 7 here, window 12 on Swin-L): torch's ONNX shape inference asserts."""
    with pytest.raises(RuntimeError, match="minus_one_pos"):
        export(tiny_swin(7), only=None)


@pytest.mark.parametrize("dropped, refused_at", [
    ("swin-window-sizes", (2, 224, 224)),  # the dummy's batch baked: silently wrong at batch 2 (0.4 off)
    ("swin-window-sizes", (1, 256, 192)),  # and its padding decision
    ("swin-patch-merging", (1, 333, 313)),  # even sizes traced, odd ones refused
    ("patch-embed-padding", (1, 333, 313)),  # 224 is whole patches, 333 is not
])
def test_each_patch_is_needed(dropped, refused_at):
    """Each patch left out, the rest applied: the graph is refused at a size it then gets wrong (the shift mask's
    own patch: without it the exporter asserts, test_unpatched_upstream_swin_does_not_even_export)."""
    model = tiny_swin(7)
    session = export(model, only=[p for p in SWIN_PATCHES if p != dropped])
    assert worst(session, model, *refused_at) > 100 * BOUND
    assert worst(session, model, 1, 224, 224) < BOUND  # still right at the dummy's own size


def test_without_the_shift_mask_patch_the_exporter_asserts():
    with pytest.raises(RuntimeError, match="minus_one_pos"):
        export(tiny_swin(7), only=[p for p in SWIN_PATCHES if p != "swin-shift-mask"])


class LookAlike(nn.Module):
    """A block with a window, a shift and norms, but another forward: not Swin's, so not touched."""

    def __init__(self):
        super().__init__()
        self.window_size, self.shift_size = 7, 3
        self.norm1, self.norm2, self.mlp = nn.LayerNorm(4), nn.LayerNorm(4), nn.Identity()
        self.attn = nn.Module()
        self.attn.relative_position_bias_table = nn.Parameter(torch.zeros(1))
        self.reduction = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm1(x)


def test_patches_touch_only_swin_modules():
    assert not any(check(LookAlike()) for check in (backbones.is_swin_block, backbones.is_swin_stage,
                                                    backbones.is_patch_merging, backbones.is_patch_embed))
    import timm
    import torchvision

    # other code of the same names: timm's Swin (its own window code), ViT, ConvNeXt and FocalNet, torchvision's
    others = [timm.create_model(name, pretrained=False) for name in
              ("swin_tiny_patch4_window7_224", "vit_tiny_patch16_224", "convnext_atto", "focalnet_tiny_srf")]
    for model in (torchvision.models.resnet18(), torchvision.models.swin_t(), *others, LookAlike()):
        with apply_patches(model=model, only=SWIN_PATCHES) as report:
            pass
        assert all(r.sites == 0 for r in report.records if r.name in SWIN_PATCHES), model.__class__.__name__
    model = tiny_swin(7)
    stage = model.layers[0]
    with apply_patches(model=model, only=SWIN_PATCHES):
        assert "forward" in vars(stage)  # an instance-level override, the class left alone
        assert type(stage).forward is upstream.BasicLayer.forward
    assert "forward" not in vars(stage)  # restored


# --- the whole Mask2Former on Swin, through the pipeline --------------------------------------------------------------
@pytest.mark.parametrize("window, sizes", [
    (7, "[[224,224],[64,64],[333,313],[256,192],[192,256]]"),
    (12, "[[384,384],[64,64],[333,313]]"),
])
def test_mask2former_on_swin_exports_verified_at_sizes_and_batches(tmp_path, window, sizes):
    built = pipeline.prepare(load("mask2former_swin_tiny", [f"export.output_dir={tmp_path}", f"verify.sizes={sizes}",
                                                             f"model.opts=[MODEL.SWIN.WINDOW_SIZE,{window}]",
                                                             "export.lint=false"]))
    assert built.model.backbone.layers[0].window_size == window
    manifest = pipeline.export(built.cfg, built=built)
    assert manifest.verification["passed"]
    cases = {c["case"] for c in manifest.verification["cases"]}
    assert any(c.startswith("batch") for c in cases) and len(cases) == len(eval(sizes)) + 1
    hits = {p["name"]: p["hits"] for p in manifest.patches if p["name"] in SWIN_PATCHES}
    assert set(hits) == set(SWIN_PATCHES) and all(hits.values()), hits
    if window == 7:  # a batch of three mixed sizes against the model's own forward
        from test_mask2former import _eager_head

        session = ort.InferenceSession(str(tmp_path / manifest.model_file), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(11)
        images = [rng.integers(0, 255, (3, h, w), dtype=np.uint8) for h, w in [(224, 224), (150, 210), (97, 64)]]
        logits, masks = _eager_head(built.model, images)
        got_logits, got_masks = session.run(None, built.adapter.graph_inputs(images))
        assert got_masks.shape == masks.shape and got_logits.shape[0] == 3
        assert np.abs(got_logits - logits).max() < 1e-4 and np.abs(got_masks - masks).max() < 1e-3


def test_torch_export_traces_the_patched_backbone_size_generally():
    """The patches' integer arithmetic under torch.export (dynamic batch, height, width): one graph for every size.
    Two stages, merging between: the first's second block shifted, the second's one block not, to keep the export
    short (each block is about a fifth of it)."""
    torch.manual_seed(1)
    model = upstream.SwinTransformer(embed_dim=16, depths=[2, 1], num_heads=[1, 2], window_size=7, drop_path_rate=0.0,
                                     out_indices=(0, 1)).eval()
    dims = {0: torch.export.Dim("b", min=1, max=8), 2: torch.export.Dim("h", min=32, max=1024),
            3: torch.export.Dim("w", min=32, max=1024)}
    with apply_patches(model=model, only=SWIN_PATCHES), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Features(model), (torch.randn(2, 3, 224, 224),), dynamo=True, input_names=["x"],
                                    output_names=OUTPUTS[:2], dynamic_shapes={"x": dims}, opset_version=18,
                                    verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for case in [(1, 224, 224), (1, 64, 64), (1, 333, 313), (3, 192, 256)]:
        assert worst(session, model, *case) < BOUND, case


def test_deepsolo_on_swin_exports_verified_at_sizes_and_a_mixed_batch(tmp_path):
    """DeepSolo's own Swin-T (depths 2/2/6/2, window 7; build_swin_backbone, imported as upstream's train_net does),
    on the tiny DeepSolo head. No size divisibility: every size pads inside the backbone. The mixed batch (224x224
    with 333x313) also needs `interpolate-nearest`: the extra level's padding mask."""
    built = pipeline.prepare(load("deepsolo_swin_tiny", [f"export.output_dir={tmp_path}", "export.lint=false",
                                                         "verify.sizes=[[224,224],[64,64],[333,313],[256,192]]"]))
    manifest = pipeline.export(built.cfg, built=built)
    assert manifest.verification["passed"]
    assert any(c["case"] == "batch 224x224+333x313" for c in manifest.verification["cases"])
    hits = {p["name"]: p["hits"] for p in manifest.patches}
    assert all(hits[name] for name in SWIN_PATCHES + ["interpolate-nearest"]), hits


def test_dinat_is_refused_in_one_line_naming_why_and_what_serves(monkeypatch):
    """OneFormer's DiNAT builds natten's neighbourhood attention: where natten is missing (stood in for import, as
    `plugin.import_only` does for OneFormer), building it says why it cannot export and what would."""
    import importlib.util
    import sys

    from d2export.patching import compiled_ops

    if importlib.util.find_spec("natten") is not None:
        pytest.skip("natten is installed here: its own ops run")
    monkeypatch.delitem(sys.modules, "natten", raising=False)
    compiled_ops.install([], import_only=["natten"])
    try:
        from natten import NeighborhoodAttention2D

        with pytest.raises(RuntimeError) as refused:
            NeighborhoodAttention2D(dim=8, kernel_size=7, dilation=1, num_heads=2)
        message = str(refused.value)
        assert "\n" not in message and "DiNAT" in message and "Swin or ConvNeXt" in message, message
    finally:
        compiled_ops._finder.names.discard("natten")
        compiled_ops._import_only.discard("natten")
        sys.modules.pop("natten", None)


_VITAE_WINDOW = '''
def window_reverse(windows, window_size, H, W):  # as DeepSolo's adet/modeling/vitae_v2/window.py reads the batch
    B = int(windows.shape[0] / (H * W / window_size / window_size))
    x = windows.view(B, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)
'''


def test_vitae_window_reverse_takes_the_batch_from_its_input(monkeypatch):
    """DeepSolo's ViTAEv2 window cells call `window_reverse` (adet/modeling/vitae_v2/window.py, bound by name in
    NormalCell and ReductionCell), whose int(...) batch bakes a batch of one: here a module of that name holding
    the same function, traced at batch 1 and run at 2 and 3, with and without the patch."""
    import sys
    import types

    names = ["adet", "adet.modeling", "adet.modeling.vitae_v2", "adet.modeling.vitae_v2.window"]
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []
        monkeypatch.setitem(sys.modules, name, module)
    window_module = sys.modules[names[-1]]
    exec(_VITAE_WINDOW, window_module.__dict__)

    class Cells(nn.Module):
        def forward(self, x):  # [B, H, W, C] -> windows -> back, through the module's own function
            return window_module.window_reverse(windows.partition(x, 4) * 2.0, 4, x.shape[1], x.shape[2])

    def graph(only):
        f = io.BytesIO()
        with apply_patches(model=Cells(), only=only), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Cells(), (torch.randn(1, 8, 12, 3),), f, input_names=["x"], output_names=["y"],
                              opset_version=17, dynamo=False,
                              dynamic_axes={"x": {0: "b", 1: "h", 2: "w"}, "y": {0: "b", 1: "h", 2: "w"}})
        return ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])

    patched, plain = graph(["vitae-window-batch"]), graph([])
    for batch, h, w in [(2, 8, 12), (3, 16, 4)]:
        x = torch.randn(batch, h, w, 3)
        want = (x * 2.0).numpy()
        assert np.array_equal(patched.run(None, {"x": x.numpy()})[0], want)
        try:
            got = plain.run(None, {"x": x.numpy()})[0]
        except Exception:  # noqa: BLE001 - the baked batch failing in onnxruntime
            continue
        assert got.shape != want.shape or not np.array_equal(got, want)
