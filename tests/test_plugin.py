"""The load-time plugin: the import hook for compiled MSDA extensions and the duck-typed MSDA swap."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from d2export.patching import compiled_ops, msda_swap
from msda_reference import msda_reference

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def test_unedited_user_code_imports_builds_and_runs_after_activate():
    r = run_python("""
        import sys, torch
        sys.path.insert(0, "third_party")
        import d2export
        d2export.activate(["testr._C"])
        import testr                               # `from testr import _C` inside: no such module on disk
        from testr.config import get_cfg
        from detectron2.modeling import build_model
        cfg = get_cfg(); cfg.merge_from_file("third_party/testr/configs/tiny.yaml"); cfg.MODEL.DEVICE = "cpu"
        model = build_model(cfg).eval()
        with torch.no_grad():                      # the unswapped model goes through the stand-in _C
            out = model([{"image": torch.rand(3, 96, 128) * 255}])[0]["instances"]
        print("served", testr._C.__d2export_stand_in__, len(out), out.polygons.shape[1])
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "served True 10 32" in r.stdout


def test_a_real_extension_wins_over_the_stand_in(tmp_path):
    pkg = tmp_path / "realpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_C.py").write_text("REAL = True\n")
    r = run_python(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        import d2export; d2export.activate(["realpkg._C", "absent_ext_d2x"])
        import realpkg._C as c, absent_ext_d2x as a
        print(getattr(c, "REAL", False), a.__d2export_stand_in__)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "True"]


def random_msda_inputs(seed=0, n=2, shapes=((6, 9), (3, 5)), m=2, d=4, lq=7, p=3):
    g = torch.Generator().manual_seed(seed)
    spatial = torch.tensor(shapes)
    start = torch.cat([spatial.new_zeros(1), spatial.prod(1).cumsum(0)[:-1]])
    value = torch.randn(n, int(spatial.prod(1).sum()), m, d, generator=g, dtype=torch.float64)
    loc = torch.rand(n, lq, m, len(shapes), p, 2, generator=g, dtype=torch.float64) * 1.2 - 0.1
    attn = torch.rand(n, lq, m, len(shapes), p, generator=g, dtype=torch.float64)
    return value, spatial, start, loc, attn / attn.sum((-1, -2), keepdim=True)


def test_stand_in_forward_and_backward_match_the_reference():
    value, spatial, start, loc, attn = random_msda_inputs()
    ext = compiled_ops.make_stand_in("fake_ext")
    out = ext.ms_deform_attn_forward(value, spatial, start, loc, attn, 64)
    torch.testing.assert_close(out, msda_reference(value, spatial, start, loc, attn), atol=1e-9, rtol=1e-9)
    grad_out = torch.randn_like(out)
    grads = ext.ms_deform_attn_backward(value, spatial, start, loc, attn, grad_out, 64)
    leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    expected = torch.autograd.grad(msda_reference(leaves[0], spatial, start, leaves[1], leaves[2]), leaves, grad_out)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-7, rtol=1e-6)


class UpstreamMSDAFunction(torch.autograd.Function):
    """How TESTR-style code calls its compiled op (saves the inputs, hands them back to the op's backward)."""

    @staticmethod
    def forward(ctx, ext, value, spatial, start, loc, attn):
        ctx.ext = ext
        ctx.save_for_backward(value, spatial, start, loc, attn)
        return ext.ms_deform_attn_forward(value, spatial, start, loc, attn, 64)

    @staticmethod
    def backward(ctx, grad_out):
        value, spatial, start, loc, attn = ctx.saved_tensors
        grads = ctx.ext.ms_deform_attn_backward(value, spatial, start, loc, attn, grad_out, 64)
        return None, grads[0], None, None, grads[1], grads[2]


def test_stand_in_backward_reuses_its_forward_and_keeps_gradients_exact(monkeypatch):
    from d2export.ops import msda

    calls = []
    core = msda.multi_scale_deformable_attention
    monkeypatch.setattr(msda, "multi_scale_deformable_attention", lambda *a: calls.append(1) or core(*a))
    ext = compiled_ops.make_stand_in("fake_ext")
    value, spatial, start, loc, attn = random_msda_inputs(n=3, shapes=((5, 7), (2, 3)))
    leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    other = (value * 2).requires_grad_(True)  # a second call on the same locations must not take the first's graph
    grad_out = torch.randn(3, 7, 8, dtype=torch.float64)
    first = UpstreamMSDAFunction.apply(ext, leaves[0], spatial, start, leaves[1], leaves[2])
    second = UpstreamMSDAFunction.apply(ext, other, spatial, start, leaves[1], leaves[2])
    got = torch.autograd.grad((first * grad_out).sum() + second.sum(), [*leaves, other])
    ref = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    ref_other = (value * 2).requires_grad_(True)
    expected = torch.autograd.grad((msda_reference(ref[0], spatial, start, ref[1], ref[2]) * grad_out).sum()
                                   + msda_reference(ref_other, spatial, start, ref[1], ref[2]).sum(), [*ref, ref_other])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-9)
    assert len(calls) == 3  # two forwards; only the overwritten one's backward ran the core again
    calls.clear()
    out = UpstreamMSDAFunction.apply(ext, leaves[0], spatial, start, leaves[1], leaves[2])
    out.backward(grad_out)
    assert len(calls) == 1  # a plain training step: the backward differentiates the forward's graph
    with torch.no_grad():  # inference: the model's tensors, computed without grad, do not require it
        UpstreamMSDAFunction.apply(ext, leaves[0] * 1, spatial, start, leaves[1] * 1, leaves[2] * 1)
    assert len(compiled_ops._graphs) == 0  # so no graph is kept


class OddlyNamedAttention(nn.Module):
    """An MSDA under another name, with the Deformable-DETR call convention: found by what it has."""

    def __init__(self, c=8, heads=2, levels=2, points=3):
        super().__init__()
        self.n_heads, self.n_levels, self.n_points = heads, levels, points
        self.sampling_offsets = nn.Linear(c, heads * levels * points * 2)
        self.attention_weights = nn.Linear(c, heads * levels * points)
        self.value_proj = nn.Linear(c, c)
        self.output_proj = nn.Linear(c, c)

    def forward(self, *args):
        raise RuntimeError("compiled op only")


def test_swap_finds_msda_by_duck_typing_and_matches_the_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), OddlyNamedAttention().double())
    assert msda_swap.swap(model) == ["1"]
    attn = model[1]
    spatial = torch.tensor([[6, 9], [3, 5]])
    start = torch.tensor([0, 54])
    query = torch.randn(2, 7, 8, dtype=torch.float64)
    flat = torch.randn(2, 69, 8, dtype=torch.float64)
    ref_points = torch.rand(2, 7, 2, 2, dtype=torch.float64)
    out = attn(query, ref_points, flat, spatial, start)
    # independent: the same projections written out here, the float64 reference core
    value = attn.value_proj(flat).view(2, 69, 2, 4)
    offsets = attn.sampling_offsets(query).view(2, 7, 2, 2, 3, 2)
    weights = attn.attention_weights(query).view(2, 7, 2, 6).softmax(-1).view(2, 7, 2, 2, 3)
    loc = ref_points[:, :, None, :, None, :] + offsets / spatial.flip(-1)[None, None, None, :, None, :]
    expected = attn.output_proj(msda_reference(value, spatial, start, loc, weights))
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=1e-9)
    msda_swap.restore(model)
    with pytest.raises(RuntimeError, match="compiled op only"):
        attn(query, ref_points, flat, spatial, start)


def test_swap_leaves_other_modules_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(8, 2))
    assert msda_swap.swap(model) == []


class MmcvStyleAttention(OddlyNamedAttention):
    """mmcv/detrex naming and call convention: num_* counts, [len, N, C] layout, residual and dropout inside."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.num_levels, self.num_points = self.n_heads, self.n_levels, self.n_points
        del self.n_heads, self.n_levels, self.n_points
        self.batch_first = False
        self.dropout = nn.Dropout(0.0)


def test_swap_handles_the_mmcv_call_convention():
    torch.manual_seed(1)
    attn = MmcvStyleAttention().double().eval()
    assert msda_swap.swap(attn) == [""] and msda_swap.convention(attn) == "mmcv"
    spatial, start = torch.tensor([[6, 9], [3, 5]]), torch.tensor([0, 54])
    query, pos = torch.randn(7, 2, 8, dtype=torch.float64), torch.randn(7, 2, 8, dtype=torch.float64)
    value = torch.randn(69, 2, 8, dtype=torch.float64)
    ref_points = torch.rand(2, 7, 2, 2, dtype=torch.float64)
    out = attn(query, value=value, query_pos=pos, reference_points=ref_points, spatial_shapes=spatial,
               level_start_index=start)
    q, v = (query + pos).transpose(0, 1), value.transpose(0, 1)
    vp = attn.value_proj(v).view(2, 69, 2, 4)
    offsets = attn.sampling_offsets(q).view(2, 7, 2, 2, 3, 2)
    weights = attn.attention_weights(q).view(2, 7, 2, 6).softmax(-1).view(2, 7, 2, 2, 3)
    loc = ref_points[:, :, None, :, None, :] + offsets / spatial.flip(-1)[None, None, None, :, None, :]
    expected = query + attn.output_proj(msda_reference(vp, spatial, start, loc, weights)).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=1e-9)
