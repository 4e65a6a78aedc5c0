"""Mask2Former's masked attention made once per query (d2export/patching/masked_decoder.py), and verification's
pinning of a threshold the graph makes once where eager makes it per head (d2export/verification/pinning.py).

The independent side is the model's own decoder, unpatched, in float64: its per-head masks, its loop's clearing of
rows that mask everything, MultiheadAttention's -inf/0 addition. Faults are planted in the patched side only."""
from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch

from d2export import pipeline
from d2export.config import load
from d2export.verification import pinning, ladder
from d2export.verification.comparison import VerificationError
from d2export.patching import apply_patches, masked_decoder

ONLY = ["masks-once-per-query", "masked-attention-per-query"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("masked_decoder")
    return pipeline.prepare(load("mask2former_tiny", [f"export.output_dir={out}", "export.lint=false",
                                                      "verify.sizes=[[128,160],[96,192]]"]))


def _features(built, shapes, seed):
    """Multi-scale features for the decoder as the pixel decoder hands them on: (mask_features, [levels])."""
    g = torch.Generator().manual_seed(seed)
    decoder = built.model.sem_seg_head.predictor
    proj = decoder.input_proj[0]
    channels = getattr(proj, "in_channels", decoder.level_embed.embedding_dim)  # an empty Sequential where equal
    n, h, w = shapes
    mask_features = torch.randn(n, decoder.mask_embed.layers[-1].out_features, h, w,
                                generator=g, dtype=torch.float64)
    levels = [torch.randn(n, channels, -(-h // s), -(-w // s), generator=g, dtype=torch.float64) for s in (8, 4, 2)]
    return mask_features, levels


def _run(decoder, mask_features, levels, patched: bool):
    with torch.no_grad():
        if not patched:
            return decoder(levels, mask_features)
        with apply_patches(decoder, target=None, only=ONLY) as report:
            out = decoder(levels, mask_features)
        hits = {r.name: r.hits for r in report.records if r.name in ONLY}
        assert all(hits.values()), hits  # both patches took the calls: the per-query path really ran
        return out


@pytest.mark.parametrize("shapes", [(1, 40, 32), (2, 24, 52), (2, 33, 17)])
def test_the_decoder_with_masks_per_query_equals_its_own_per_head_masks_in_float64(built, shapes):
    decoder = built.model.sem_seg_head.predictor.double()
    try:
        mask_features, levels = _features(built, shapes, seed=11)
        ours, theirs = (_run(decoder, mask_features, levels, p) for p in (True, False))
        for name in ("pred_logits", "pred_masks"):
            assert ours[name].shape == theirs[name].shape
            assert torch.allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-12), name
    finally:
        decoder.float()


def test_queries_that_mask_everything_attend_everywhere_as_upstreams_loop_makes_them(built):
    """Constant mask features: each query's mask logit is one number over the picture, so every query either masks
    every position (the loop must clear it) or none; both kinds present, results equal in float64."""
    decoder = built.model.sem_seg_head.predictor.double()
    try:
        mask_features, levels = _features(built, (2, 24, 20), seed=5)
        mask_features = torch.ones_like(mask_features)
        seen = []
        hook = decoder.mask_embed.register_forward_hook(lambda m, a, out: seen.append(out.sum(-1)))
        theirs = _run(decoder, mask_features, levels, False)
        hook.remove()
        signs = torch.stack(seen) < 0
        assert signs.any() and (~signs).any()  # some rows mask everything, some nothing
        ours = _run(decoder, mask_features, levels, True)
        for name in ("pred_logits", "pred_masks"):
            assert torch.allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-12), name
    finally:
        decoder.float()


def test_a_decoder_whose_masks_differ_from_the_per_query_ones_keeps_its_own(built, monkeypatch):
    """Where the traced values show another mask than ours (a fork's threshold), the decoder's own per head stay."""
    decoder = built.model.sem_seg_head.predictor
    monkeypatch.setattr(masked_decoder, "per_query_masks",
                        lambda m, size: torch.nn.functional.interpolate(m, size=size, mode="bilinear").flatten(2) < 1)
    mask_features, levels = _features(built, (1, 24, 20), 3)
    mask_features, levels = mask_features.float(), [x.float() for x in levels]
    with torch.no_grad(), apply_patches(decoder, target=None, only=ONLY) as report:
        ours = decoder(levels, mask_features)
    assert {r.name: r.hits for r in report.records if r.name in ONLY}["masked-attention-per-query"] == 0
    theirs = decoder(levels, mask_features)
    assert torch.equal(ours["pred_masks"], theirs["pred_masks"])


def test_multihead_attention_elsewhere_is_left_to_torch():
    attention = torch.nn.MultiheadAttention(16, 4).eval()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2, 16, generator=g), torch.randn(7, 2, 16, generator=g)
    mask = torch.rand(8, 5, 7, generator=g) < 0.3
    before = attention(q, k, k, attn_mask=mask)
    with apply_patches(attention, target=None, only=ONLY) as report:
        after = attention(q, k, k, attn_mask=mask)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    record = next(r for r in report.records if r.name == "masked-attention-per-query")
    assert record.hits == 0 and record.deferred == 1


def test_only_decoders_of_upstreams_signature_are_matched(built):
    class Other(torch.nn.Module):
        num_heads, transformer_cross_attention_layers = 8, torch.nn.ModuleList()

        def forward_prediction_heads(self, output, mask_features, attn_mask_target_size, layer):
            return output

    assert masked_decoder.is_masked_decoder(built.model.sem_seg_head.predictor)
    assert not masked_decoder.is_masked_decoder(Other())
    assert not masked_decoder.is_masked_decoder(built.model.sem_seg_head.pixel_decoder)


# --- the graph -------------------------------------------------------------------------------------------------
def _predictor_nodes(path):
    graph = onnx.load(str(path), load_external_data=False).graph
    made = {o: n for n in graph.node for o in n.output}
    nodes = [n for n in graph.node if "/predictor/" in n.name]
    return nodes, made


def _ancestors(node, made, depth=12):
    seen, front = [], [node]
    for _ in range(depth):
        front = [made[i] for n in front for i in n.input if i in made]
        seen += front
    return seen


def test_the_graph_makes_each_attention_mask_once_per_query_and_verifies(built):
    manifest = pipeline.export(built.cfg, built=built)
    assert manifest.verification["passed"]
    nodes, made = _predictor_nodes(built.cfg.export.output_dir + "/" + manifest.model_file)
    kinds = collections.Counter(n.op_type for n in nodes)
    assert kinds["NonZero"] == 0 and kinds["ScatterND"] == 0  # the loop's per-head clearing left the graph
    thresholds = [n for n in nodes if n.op_type == "Less"]
    assert thresholds
    for less in thresholds:  # none reads a per-head repeat
        assert not any(a.op_type == "Tile" for a in _ancestors(less, made)), less.name
    hits = {p["name"]: p["hits"] for p in manifest.patches}
    assert hits["masks-once-per-query"] > 0 and hits["masked-attention-per-query"] > 0


def test_a_wrong_per_query_mask_is_refused(built, monkeypatch):
    """The per-query masks at threshold 0.4 (the trace-time check switched off, as under torch.export): the graph
    attends elsewhere than the model, and verification refuses it."""
    monkeypatch.setattr(ladder, "_ladder_summary", lambda subject: {"culprit": None})
    monkeypatch.setattr(masked_decoder, "_differs", lambda ours, theirs: False)

    def wrong(outputs_mask, size):
        probs = torch.nn.functional.interpolate(outputs_mask, size=size, mode="bilinear", align_corners=False)
        masked = probs.sigmoid().flatten(2) < 0.4
        return masked & ~masked.all(-1, keepdim=True)

    monkeypatch.setattr(masked_decoder, "per_query_masks", wrong)
    with pytest.raises(VerificationError):
        pipeline.export(built.cfg, built=built)


# --- pinning through the copies --------------------------------------------------------------------------------
def test_copies_are_counted_only_where_eager_repeats_what_the_graph_computes_once():
    once = torch.rand(2, 5, 7)
    repeated = once[:, None].expand(2, 8, 5, 7).reshape(16, 5, 7)
    assert pinning._copies(repeated, (2, 5, 7)) == 8
    assert pinning._copies(once, (2, 5, 7)) == 0  # the same shape is the plain match
    assert pinning._copies(repeated, (2, 5, 6)) == 0 and pinning._copies(repeated, (3, 5, 7)) == 0
    other = repeated.clone()
    other[9, 0, 0] += 1e-7  # one head's copy off by one ulp-sized step: not copies
    assert pinning._copies(other, (2, 5, 7)) == 0


def test_a_threshold_made_once_is_pinned_against_eagers_copies_and_tiled_back():
    g = torch.Generator().manual_seed(2)
    once = torch.rand(2, 5, 7, generator=g, dtype=torch.float64)
    once[0, 1, 3] = 0.5 - 1e-7  # eager just below the threshold; the graph just above it
    graph_values = once.numpy().astype(np.float32).copy()
    graph_values[0, 1, 3] = np.float32(0.5 + 1e-7)
    threshold = pinning._GraphThreshold("Less_0", graph_values, "lt", 0.5, graph_values < np.float32(0.5))
    pinner = pinning._Pinner([threshold], pinning.Tolerances(1e-5, 1e-5, 1e-5), None, None,
                             compare={"lt": torch.Tensor.__lt__})
    repeated = once[:, None].expand(2, 8, 5, 7).reshape(16, 5, 7)
    result = pinner.comparison("lt", repeated, 0.5)
    assert result.shape == (16, 5, 7) and pinner.matched_thresholds == 1
    expected = torch.from_numpy(graph_values < np.float32(0.5))[:, None].expand(2, 8, 5, 7).reshape(16, 5, 7)
    assert torch.equal(result, expected)  # the graph's pick, on every head
    assert pinner.found and pinner.found[0].positions == 1 and pinner.found[0].tied
