"""Mask2Former through the torch.export-based exporter (export.exporter=dynamo): the pixel decoder's split of the
encoder's memory by level sizes held in tensors is what torch.export could not guard on; the
`level-sizes-for-torch-export` patch hands them over as Python sizes under torch.export only. (A file of its own: the
tiny model's dynamo export takes about two minutes on one core.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from d2export.patching import apply_patches
from exports import export

PATCH = "level-sizes-for-torch-export"
SIZES = "sizes-as-tensor"  # every export stacks traced sizes (torch.as_tensor of them would bake them)


class EncoderOnly(nn.Module):
    """As MSDeformAttnTransformerEncoderOnly hands its levels on: the memory, and the level sizes as tensors."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Identity()
        self.level_embed = nn.Parameter(torch.zeros(2, 3))

    def forward(self, srcs, pos_embeds):
        shapes = torch.as_tensor([s.shape[-2:] for s in srcs], dtype=torch.long)
        starts = torch.cat((shapes.new_zeros((1,)), shapes.prod(1).cumsum(0)[:-1]))
        memory = torch.cat([self.encoder(s + p).flatten(2).transpose(1, 2) for s, p in zip(srcs, pos_embeds)], 1)
        return memory, shapes, starts


class PixelDecoder(nn.Module):
    """Mask2Former's forward_features' split and views, as its code reads the sizes."""

    def __init__(self):
        super().__init__()
        self.transformer = EncoderOnly()

    def forward(self, fine, coarse):
        y, shapes, starts = self.transformer([fine, coarse], [fine * 0, coarse * 0])
        sections = [starts[1] - starts[0], y.shape[1] - starts[1]]
        parts = torch.split(y, sections, dim=1)
        return tuple(z.transpose(1, 2).view(y.shape[0], -1, shapes[i][0], shapes[i][1]) for i, z in enumerate(parts))


def _export(model, args):
    batch, h, w = torch.export.Dim("batch", min=2), torch.export.Dim("h", min=2), torch.export.Dim("w", min=2)
    shapes = ({0: batch, 2: 2 * h, 3: 2 * w}, {0: batch, 2: h, 3: w})
    return torch.export.export(model, args, dynamic_shapes=shapes)


def test_level_sizes_as_python_sizes_let_torch_export_split_and_view_the_levels():
    model = PixelDecoder().eval()
    args = (torch.rand(2, 3, 8, 12), torch.rand(2, 3, 4, 6))
    with apply_patches(model=model, only=[SIZES]), pytest.raises(Exception, match="data-dependent"):
        _export(model, args)  # the pixel decoder as written: torch.export cannot guard on the sizes' values
    with apply_patches(model=model, only=[SIZES, PATCH]) as report:
        program = _export(model, args)
        eager = model(*args)  # eagerly the patch defers: the encoder's own tensors
    assert {p["name"]: p["status"] for p in report.to_dict()["patches"]}[PATCH] == "applied"
    assert isinstance(model.transformer(*[[args[0]], [args[0]]])[1], torch.Tensor)
    other = (torch.rand(3, 3, 10, 6), torch.rand(3, 3, 5, 3))  # another batch and size than traced
    for got, want in zip(program.module()(*other), model(*other)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    for got, want in zip(program.module()(*args), eager):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_the_tiny_mask2former_exports_through_torch_export_verified(tmp_path):
    # one deformable encoder layer of the tiny config's two and one masked-attention decoder layer of three (DEC_LAYERS
    # counts the query prediction before them): the others trace the same code again, 107 -> 84 s here; the pixel
    # decoder still makes every level the masks are resized to
    manifest = export("mask2former_tiny", tmp_path, "export.exporter=dynamo",
                      "model.opts=[MODEL.SEM_SEG_HEAD.TRANSFORMER_ENC_LAYERS,1,MODEL.MASK_FORMER.DEC_LAYERS,2]",
                      "verify.sizes=[[128,160],[96,192]]")
    v = manifest.verification
    assert v["passed"] is True and any(c["case"].startswith("batch ") for c in v["cases"])
    assert manifest.exporter == "dynamo"
    assert v["lint"]["clean"] is True
    hits = {p["name"]: p["hits"] for p in manifest.patches}
    assert any(p["name"] == "level-sizes-for-torch-export" and p["status"] == "applied" for p in manifest.patches)
    assert hits["masks-once-per-query"] and hits["masked-attention-per-query"]  # the masks once per query, there too


def test_torch_export_traces_a_batch_only_where_the_graph_takes_one():
    # torch.export specialises a batch of 1, so a batch-general graph is traced on two dummies; detectron2's own
    # detectors take one image per run and are traced on one (two were refused by their adapter)
    from d2export.config import load
    from d2export.exporting.onnx_export import traced_sizes

    cfg = load("boxdet", ["export.exporter=dynamo", "export.output_dir=/nowhere"])
    one = [tuple(s) for s in cfg.export.dummy_sizes]
    assert len(one) == 1
    assert traced_sizes(cfg, batchable=False) == one and traced_sizes(cfg) == one * 2
    assert traced_sizes(load("boxdet", ["export.output_dir=/nowhere"]), batchable=True) == one  # TorchScript traces what is asked
