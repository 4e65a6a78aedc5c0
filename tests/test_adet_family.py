"""The AdelaiDet-lineage rewrites are exact against the original code (third_party's TESTR stand-in) at every size,
and stay size-general when traced."""
from __future__ import annotations

import pytest
import torch

from d2export.ops import level_shapes
from d2export.ops import detr_sizes
from d2export.patching import compiled_ops

compiled_ops.install(["testr._C"])
from testr.layers.deformable_transformer import DeformableTransformer, DeformableTransformerEncoder  # noqa: E402
from testr.modeling.transformer_detector import MaskedBackbone  # noqa: E402

SIZES = [[(37, 53), (40, 40)], [(64, 24)], [(17, 90), (90, 17), (50, 51)]]


def feature_sizes(hmax, wmax, strides=(8, 16, 32)):
    return [(-(-hmax // s), -(-wmax // s)) for s in strides]


def masks_original(image_sizes, strides=(8, 16, 32)):
    wrapper = MaskedBackbone.__new__(MaskedBackbone)
    wrapper.feature_strides = list(strides)
    hmax, wmax = max(h for h, _ in image_sizes), max(w for _, w in image_sizes)
    shapes = [(len(image_sizes), 1, h, w) for h, w in feature_sizes(hmax, wmax, strides)]
    return wrapper, shapes, MaskedBackbone.mask_out_padding(wrapper, shapes, image_sizes, "cpu")


@pytest.mark.parametrize("image_sizes", SIZES)
def test_padding_masks_equal_the_original(image_sizes):
    wrapper, shapes, expected = masks_original(image_sizes)
    for sizes in (image_sizes, torch.tensor(image_sizes)):
        got = detr_sizes.mask_out_padding(wrapper, shapes, sizes, "cpu")
        for g, e in zip(got, expected):
            assert torch.equal(g, e.bool())


def flat_inputs(image_sizes, c=256):
    _, _, masks = masks_original(image_sizes)
    spatial = torch.tensor([m.shape[1:] for m in masks])
    mask_flat = torch.cat([m.flatten(1) for m in masks], 1).bool()
    valid = torch.stack([DeformableTransformer.get_valid_ratio(None, m.bool()) for m in masks], 1)
    memory = torch.randn(len(image_sizes), mask_flat.shape[1], c, generator=torch.Generator().manual_seed(1))
    return spatial, mask_flat, valid, memory


@pytest.mark.parametrize("image_sizes", SIZES)
def test_reference_points_equal_the_original(image_sizes):
    spatial, _, valid, _ = flat_inputs(image_sizes)
    expected = DeformableTransformerEncoder.get_reference_points(spatial, valid, "cpu")
    torch.testing.assert_close(detr_sizes.get_reference_points(spatial, valid, "cpu"), expected, rtol=0, atol=0)


@pytest.mark.parametrize("image_sizes", SIZES)
def test_encoder_proposals_equal_the_original(image_sizes):
    spatial, mask_flat, _, memory = flat_inputs(image_sizes)
    torch.manual_seed(0)
    transformer = DeformableTransformer(d_model=256, nhead=8, num_encoder_layers=1, num_decoder_layers=1,
                                        dim_feedforward=64, num_feature_levels=3, num_proposals=5).eval()
    expected = transformer.gen_encoder_output_proposals(memory, mask_flat, spatial)
    got = detr_sizes.gen_encoder_output_proposals(transformer, memory, mask_flat, spatial)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_sizes_stack_into_a_traced_tensor():
    class Shapes(torch.nn.Module):
        def forward(self, a, b):
            sizes = [a.shape[-2:], b.shape[-2:]]
            seen.append(level_shapes.holds_size(sizes))  # traced sizes are 0-d tensors
            return level_shapes.stack_sizes(sizes).prod(1)

    seen = []
    traced = torch.jit.trace(Shapes(), (torch.zeros(1, 4, 6), torch.zeros(1, 2, 3)), check_trace=False)
    assert seen == [True]
    assert traced(torch.zeros(1, 5, 7), torch.zeros(1, 3, 3)).tolist() == [35, 9]
    assert level_shapes.stack_sizes([(4, 6), (2, 3)]).tolist() == [[4, 6], [2, 3]]


# ------------------------------------- the family's module patches, exported at one size and run at others
class EncoderSide(torch.nn.Module):
    """TESTR's path from feature maps to the two-stage proposals, with the stand-in's own modules: padding masks
    (MaskedBackbone.mask_out_padding), spatial_shapes from a list (torch.as_tensor), the encoder (reference points,
    MSDeformAttn) and gen_encoder_output_proposals — each a place a patch of the family rewrites."""

    def __init__(self, strides=(8, 16, 32)):
        super().__init__()
        self.backbone = MaskedBackbone.__new__(MaskedBackbone)  # only its mask_out_padding: no real backbone
        torch.nn.Module.__init__(self.backbone)
        self.backbone.feature_strides = list(strides)
        torch.manual_seed(0)
        self.transformer = DeformableTransformer(d_model=256, nhead=8, num_encoder_layers=1, num_decoder_layers=1,
                                                 dim_feedforward=64, num_feature_levels=len(strides))

    def forward(self, f8, f16, f32, image_sizes):
        t, srcs = self.transformer, [f8, f16, f32]
        masks = self.backbone.mask_out_padding([s.shape for s in srcs], image_sizes, f8.device)
        spatial_shapes = torch.as_tensor([s.shape[-2:] for s in srcs], dtype=torch.long)
        level_start_index = torch.cat((spatial_shapes.new_zeros((1,)), spatial_shapes.prod(1).cumsum(0)[:-1]))
        valid_ratios = torch.stack([t.get_valid_ratio(m) for m in masks], 1)
        flat = torch.cat([s.flatten(2).transpose(1, 2) for s in srcs], 1)
        mask_flat = torch.cat([m.flatten(1) for m in masks], 1)
        memory = t.encoder(flat, spatial_shapes, level_start_index, valid_ratios, None, mask_flat)
        projected, proposals = t.gen_encoder_output_proposals(memory, mask_flat, spatial_shapes)
        return memory, projected, proposals.clamp(-50, 50)  # invalid proposals are inf


def encoder_side_inputs(image_sizes, c=256, seed=0):
    """Feature maps of a padded batch of images (padded to the largest, as ImageList does) and the image sizes."""
    g = torch.Generator().manual_seed(seed)
    hmax, wmax = max(h for h, _ in image_sizes), max(w for _, w in image_sizes)
    feats = [torch.randn(len(image_sizes), c, h, w, generator=g) for h, w in feature_sizes(hmax, wmax)]
    return (*feats, torch.tensor(image_sizes))


def test_family_module_patches_are_size_general_through_apply_patches():
    """Exported through apply_patches(model=...) at one batch of sizes, run in onnxruntime at transposed, non-square
    and odd ones: equal to the stand-in's own code without patches (float64). With the TorchScript-based exporter,
    the padding masks and spatial_shapes bake sizes without their patches; reference points and proposals are needed
    under torch.export (tests/test_dynamo_exporter.py: the tiny spotter through it at two sizes and a batch)."""
    import copy
    import io

    import numpy as np
    import onnxruntime as ort

    from d2export.patching import Target, apply_patches

    model = EncoderSide().eval()
    names = ["f8", "f16", "f32", "image_sizes"]
    axes = {n: {0: "n", 2: f"h{n}", 3: f"w{n}"} for n in names[:3]} | {"image_sizes": {0: "n"}}
    f = io.BytesIO()
    with apply_patches(model=model, target=Target(17)) as report, torch.no_grad():
        torch.onnx.export(model, encoder_side_inputs([(100, 150), (88, 130)]), f, opset_version=17, dynamo=False,
                          input_names=names, dynamic_axes=axes)
    for name in ("msda-core", "sizes-as-tensor", "padding-mask-from-sizes", "reference-points-per-level",
                 "encoder-proposals-per-level"):
        assert report[name].hits > 0, name
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    reference = copy.deepcopy(model).double()  # the stand-in's own code, no patch, float64
    for sizes in ([(150, 100), (130, 88)], [(120, 40)], [(40, 120), (64, 90), (33, 17)]):
        inputs = encoder_side_inputs(sizes, seed=len(sizes))
        with torch.no_grad():
            expected = reference(*[x.double() if x.is_floating_point() else x for x in inputs])
        got = session.run(None, {n: x.numpy() for n, x in zip(names, inputs)})
        for g, e in zip(got, expected):
            assert g.shape == tuple(e.shape), sizes
            np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-4, err_msg=str(sizes))
