"""The AdelaiDet-lineage rewrites are exact against the original code (third_party's TESTR stand-in) at every size,
and stay size-general when traced."""
from __future__ import annotations

import pytest
import torch

from d2export.ops import level_shapes
from d2export.patching import adet_family, compiled_ops

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
        got = adet_family.mask_out_padding(wrapper, shapes, sizes, "cpu")
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
    torch.testing.assert_close(adet_family.get_reference_points(spatial, valid, "cpu"), expected, rtol=0, atol=0)


@pytest.mark.parametrize("image_sizes", SIZES)
def test_encoder_proposals_equal_the_original(image_sizes):
    spatial, mask_flat, _, memory = flat_inputs(image_sizes)
    torch.manual_seed(0)
    transformer = DeformableTransformer(d_model=256, nhead=8, num_encoder_layers=1, num_decoder_layers=1,
                                        dim_feedforward=64, num_feature_levels=3, num_proposals=5).eval()
    expected = transformer.gen_encoder_output_proposals(memory, mask_flat, spatial)
    got = adet_family.gen_encoder_output_proposals(transformer, memory, mask_flat, spatial)
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
