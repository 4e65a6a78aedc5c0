"""MaskDINO's two-stage proposals: its free function `gen_encoder_output_proposals` (maskdino/utils/utils.py, bound
by name in maskdino_decoder.py) reads each level's size out of `spatial_shapes`, which torch.export cannot slice by.
The patch computes the same from the sizes d2export remembers on that tensor: equal to MaskDINO's own loop (written
here from upstream's) at sizes and paddings the trace never saw, and it is what lets torch.export capture the decoder."""
from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from d2export.patching import apply_patches

PATCH = "encoder-proposals-free-function"


def maskdino_proposals(memory, memory_padding_mask, spatial_shapes):
    """Upstream's loop: linspace grids per level over the valid part, boxes 0.05 * 2^level, invalid tokens zeroed."""
    n = memory.shape[0]
    proposals, cur = [], 0
    for lvl, (h, w) in enumerate(spatial_shapes):
        mask = memory_padding_mask[:, cur:cur + h * w].view(n, h, w, 1)
        valid_h = torch.sum(~mask[:, :, 0, 0], 1)
        valid_w = torch.sum(~mask[:, 0, :, 0], 1)
        gy, gx = torch.meshgrid(torch.linspace(0, h - 1, h, dtype=torch.float32),
                                torch.linspace(0, w - 1, w, dtype=torch.float32), indexing="ij")
        grid = torch.cat([gx.unsqueeze(-1), gy.unsqueeze(-1)], -1)
        scale = torch.cat([valid_w.unsqueeze(-1), valid_h.unsqueeze(-1)], 1).view(n, 1, 1, 2)
        grid = (grid.unsqueeze(0).expand(n, -1, -1, -1) + 0.5) / scale
        proposals.append(torch.cat((grid, torch.ones_like(grid) * 0.05 * (2.0 ** lvl)), -1).view(n, -1, 4))
        cur += h * w
    proposals = torch.cat(proposals, 1)
    valid = ((proposals > 0.01) & (proposals < 0.99)).all(-1, keepdim=True)
    proposals = torch.log(proposals / (1 - proposals))
    proposals = proposals.masked_fill(memory_padding_mask.unsqueeze(-1), float("inf")).masked_fill(~valid, float("inf"))
    memory = memory.masked_fill(memory_padding_mask.unsqueeze(-1), 0.0).masked_fill(~valid, 0.0)
    return memory, proposals


class Decoder(torch.nn.Module):
    """The part of MaskDINO's decoder forward around the call: levels flattened, spatial_shapes by torch.as_tensor,
    padding masks from the image sizes, then the module-level function."""

    def forward(self, features: list[torch.Tensor], image_hw: torch.Tensor):
        module = sys.modules[DECODER]
        flat, masks, shapes = [], [], []
        for stride, x in zip((8, 16, 32), features):
            h, w = x.shape[-2:]
            shapes.append(x.shape[-2:])
            flat.append(x.flatten(2).transpose(1, 2))
            valid = torch.div(image_hw + stride - 1, stride, rounding_mode="floor")
            rows = torch.arange(h)[None, :, None] >= valid[:, 0, None, None]
            cols = torch.arange(w)[None, None, :] >= valid[:, 1, None, None]
            masks.append((rows | cols).flatten(1))
        spatial_shapes = torch.as_tensor(shapes, dtype=torch.long)
        return module.gen_encoder_output_proposals(torch.cat(flat, 1), torch.cat(masks, 1), spatial_shapes)


UTILS, DECODER = "maskdino.utils.utils", "maskdino.modeling.transformer_decoder.maskdino_decoder"


@pytest.fixture
def maskdino_modules(monkeypatch):
    """MaskDINO's two modules as the patch finds them: the function, and the decoder's module holding it by name."""
    for name in ("maskdino", "maskdino.utils", "maskdino.modeling", "maskdino.modeling.transformer_decoder"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    utils, decoder = types.ModuleType(UTILS), types.ModuleType(DECODER)
    utils.gen_encoder_output_proposals = decoder.gen_encoder_output_proposals = maskdino_proposals
    monkeypatch.setitem(sys.modules, UTILS, utils)
    monkeypatch.setitem(sys.modules, DECODER, decoder)
    for parent, child in (("maskdino", "utils"), ("maskdino.utils", "utils"), ("maskdino", "modeling"),
                          ("maskdino.modeling", "transformer_decoder"),
                          ("maskdino.modeling.transformer_decoder", "maskdino_decoder")):
        monkeypatch.setattr(sys.modules[parent], child, sys.modules[f"{parent}.{child}"], raising=False)
    return utils, decoder


def inputs(batch_hw, c=4, seed=0):
    """Features of a padded batch whose pictures are `batch_hw` (the largest sets the padded size)."""
    g = torch.Generator().manual_seed(seed)
    hmax, wmax = max(h for h, _ in batch_hw), max(w for _, w in batch_hw)
    feats = [torch.randn(len(batch_hw), c, -(-hmax // s), -(-wmax // s), generator=g) for s in (8, 16, 32)]
    return feats, torch.tensor(batch_hw)


@pytest.mark.parametrize("batch_hw", [[(320, 320)], [(333, 313), (200, 410)], [(64, 480), (480, 64), (97, 129)]])
def test_patched_proposals_equal_maskdinos_own(maskdino_modules, batch_hw):
    feats, sizes = inputs(batch_hw)
    expected = Decoder()(feats, sizes)
    with apply_patches(target=None, only=[PATCH]) as report:
        got = Decoder()(feats, sizes)
        assert sys.modules[DECODER].gen_encoder_output_proposals is not maskdino_proposals
    assert sys.modules[DECODER].gen_encoder_output_proposals is maskdino_proposals  # restored
    assert next(r for r in report.records if r.name == PATCH).hits == 1
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


DYNAMIC = ([{0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO}] * 3,
           {0: torch.export.Dim.AUTO})


def test_without_the_patch_torch_export_cannot_capture_the_decoder(maskdino_modules):
    """`sizes-as-tensor` alone: MaskDINO's own loop slices by the levels' sizes read back out of a tensor."""
    feats, sizes = inputs([(320, 320), (256, 300)])
    with apply_patches(target=None, only=["sizes-as-tensor"]) as report, \
            pytest.raises(GuardOnDataDependentSymNode, match="data-dependent expression u[0-9]+"):
        torch.export.export(Decoder(), (feats, sizes), dynamic_shapes=DYNAMIC, strict=False)
    assert report["sizes-as-tensor"].hits == 1  # applied: what fails is the function's loop


def test_without_sizes_as_tensor_the_capture_holds_at_the_traced_sizes_only(maskdino_modules):
    """The patch alone: `torch.as_tensor` of the traced sizes makes them constants, so the capture succeeds but the
    program is specialised to the traced picture: another size is refused."""
    feats, sizes = inputs([(320, 320), (256, 300)])
    with apply_patches(target=None, only=[PATCH]) as report:
        program = torch.export.export(Decoder(), (feats, sizes), dynamic_shapes=DYNAMIC, strict=False)
    assert report[PATCH].hits == 1
    other, other_sizes = inputs([(333, 313)], seed=1)
    with pytest.raises(AssertionError, match=r"Guard failed: features\[0\]\.size\(\)\[2\] == 40"):
        program.module()(other, other_sizes)


def test_torch_export_captures_the_decoder_only_with_the_patch(maskdino_modules):
    feats, sizes = inputs([(320, 320), (256, 300)])
    with apply_patches(target=None, only=[PATCH, "sizes-as-tensor"]):
        program = torch.export.export(Decoder(), (feats, sizes), dynamic_shapes=DYNAMIC, strict=False)
    for batch_hw in ([(333, 313)], [(64, 480), (480, 64), (97, 129)]):
        other, other_sizes = inputs(batch_hw, seed=1)
        expected = Decoder()(other, other_sizes)
        for g, e in zip(program.module()(other, other_sizes), expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
