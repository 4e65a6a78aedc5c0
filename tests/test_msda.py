"""MSDA core: parity with an independent float64 reference for every sampler, eager and through onnxruntime."""
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from d2export.ops.msda import SAMPLERS, multi_scale_deformable_attention, resolve_sampler, use_sampler
from msda_reference import edge_locations, msda_reference, random_msda_inputs

torch.set_num_threads(1)

CASES = [  # (level shapes (H, W), batch, heads, dim, points)
    ([(5, 7)], 1, 1, 4, 1),
    ([(6, 4), (3, 2)], 2, 3, 5, 2),
    ([(7, 9), (4, 5), (2, 3)], 3, 2, 8, 4),
    ([(8, 5), (4, 3), (2, 2), (1, 1), (1, 3)], 2, 2, 4, 3),  # 5 levels, 1-pixel-high/wide ones
]
EAGER = [s for s in SAMPLERS if s != "auto"] + ["auto"]
NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]


def _close(out, ref, atol):
    assert out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err < atol, f"max abs error {err}"


@pytest.mark.parametrize("lq", [9, 120, "self"])  # decoder-like and encoder-like (Lq = S): both gather layouts
@pytest.mark.parametrize("sampler", EAGER)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_eager_parity(sampler, case, lq):
    shapes, n, heads, dim, points = CASES[case]
    lq = sum(h * w for h, w in shapes) if lq == "self" else lq
    args = random_msda_inputs(shapes, n=n, lq=lq, heads=heads, dim=dim, points=points, seed=case)
    _close(multi_scale_deformable_attention(*args, sampler=sampler), msda_reference(*args), 2e-6)


@pytest.mark.parametrize("sampler", ["gather", "pytorch"])
def test_float64_is_exact(sampler):
    args = random_msda_inputs([(6, 5), (3, 3), (1, 2)], n=2, lq=11, heads=2, dim=3, points=3, dtype=torch.float64)
    out = multi_scale_deformable_attention(*args, sampler=sampler)
    assert out.dtype == torch.float64
    _close(out, msda_reference(*args), 1e-12)


@pytest.mark.parametrize("sampler", ["gather", "pytorch", "grid_sample"])
def test_pixel_edges_and_far_outside(sampler):
    """Locations on pixel centres and edges, exactly on and beyond the image border, and far outside."""
    h, w = 3, 4
    grid = edge_locations(h, w)
    value, shapes, starts, _, _ = random_msda_inputs([(h, w)], n=1, heads=1, dim=3, points=1)
    attn = torch.ones(1, grid.shape[1], 1, 1, 1)
    args = (value, shapes, starts, grid, attn)
    _close(multi_scale_deformable_attention(*args, sampler=sampler), msda_reference(*args), 1e-6)


def test_reference_matches_grid_sample():
    """The reference itself agrees with F.grid_sample(value_l, 2 * loc - 1) in float64, level by level."""
    shapes = [(5, 6), (2, 3)]
    value, ss, starts, loc, attn = random_msda_inputs(shapes, n=2, lq=4, heads=2, dim=3, points=2,
                                                      dtype=torch.float64)
    expected = 0
    for level, ((h, w), start) in enumerate(zip(shapes, starts.tolist())):
        image = value[:, start:start + h * w].reshape(2, h, w, 2, 3).permute(0, 3, 4, 1, 2).reshape(4, 3, h, w)
        grid = (2 * loc[:, :, :, level] - 1).transpose(1, 2).reshape(4, 4, 2, 2)
        sampled = F.grid_sample(image, grid, align_corners=False).view(2, 2, 3, 4, 2)  # n m d q p
        expected = expected + (sampled * attn[:, :, :, level].permute(0, 2, 1, 3).unsqueeze(2)).sum(-1)
    expected = expected.permute(0, 3, 1, 2).reshape(2, 4, 6)
    _close(msda_reference(value, ss, starts, loc, attn), expected, 1e-12)


@pytest.mark.parametrize("sampler", ["gather", "pytorch", "grid_sample"])
def test_gradients_match_reference(sampler):
    args = random_msda_inputs([(5, 4), (3, 2)], n=2, lq=5, heads=2, dim=3, points=2, dtype=torch.float64)
    value, ss, starts, loc, attn = (a.clone().requires_grad_(a.is_floating_point()) for a in args)
    grads = torch.autograd.grad(multi_scale_deformable_attention(value, ss, starts, loc, attn, sampler=sampler)
                                .square().sum(), (value, loc, attn))
    ref = torch.autograd.grad(msda_reference(value, ss, starts, loc, attn).square().sum(), (value, loc, attn))
    for g, r in zip(grads, ref):
        assert g.abs().max() > 0
        _close(g, r, 1e-10)


@pytest.mark.parametrize("sampler", ["gather", "pytorch"])
def test_float16_inputs(sampler):
    args = random_msda_inputs([(16, 24), (8, 12)], n=1, lq=20, heads=2, dim=4, points=2)
    half = [a.half() if a.is_floating_point() else a for a in args]
    out = multi_scale_deformable_attention(*half, sampler=sampler)
    assert out.dtype == torch.float16
    # fp16 values and weights, float32 sampling arithmetic: fp16 rounding only
    _close(out, msda_reference(*half), 5e-3)


def test_sampler_resolution():
    assert resolve_sampler("auto") == "pytorch"  # eager
    for name in ("gather", "grid_sample", "pytorch", "trt_plugin"):
        assert resolve_sampler(name) == name
    with pytest.raises(ValueError):
        resolve_sampler("cuda")
    with pytest.raises(ValueError):
        with use_sampler("nope"):
            pass


class _Core(torch.nn.Module):
    def __init__(self, sampler="auto"):
        super().__init__()
        self.sampler = sampler

    def forward(self, *args):
        return multi_scale_deformable_attention(*args, sampler=self.sampler)


def _export(module, args, opset):
    buf = io.BytesIO()
    dynamic = {"value": {0: "n", 1: "s"}, "sampling_locations": {0: "n", 1: "q"},
               "attention_weights": {0: "n", 1: "q"}, "out": {0: "n", 1: "q"}}
    torch.onnx.export(module, args, buf, input_names=NAMES, output_names=["out"], dynamic_axes=dynamic,
                      opset_version=opset, dynamo=False)
    model = onnx.load_from_string(buf.getvalue())
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model, args):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    used = {i.name for i in session.get_inputs()}  # level starts may come from the sizes: the graph drops them
    return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in zip(NAMES, args) if k in used})[0])


# Exported at the first shapes, run at the others: other sizes and aspect ratios, the same token count with the
# other aspect ratio (a baked shape would run and silently return wrong numbers), another batch and query count.
EXPORT_SHAPES = [(6, 4), (3, 2), (2, 1)]
RUN_SHAPES = [
    ([(4, 6), (2, 3), (1, 2)], 1, 7),
    ([(9, 5), (5, 3), (3, 2)], 3, 4),
    ([(3, 8), (2, 4), (1, 1)], 2, 13),
]


@pytest.mark.parametrize("sampler,opset,lq", [("gather", 11, 5), ("gather", 17, 5), ("gather", 11, "self"),
                                              ("gather", 17, 40), ("grid_sample", 16, 5), ("grid_sample", 19, 5)])
def test_onnx_parity_at_other_sizes(sampler, opset, lq):
    """Traced as self-attention (Lq = S: gathered in pieces) or with other query counts (at once)."""
    lq = sum(h * w for h, w in EXPORT_SHAPES) if lq == "self" else lq
    model = _export(_Core(sampler), random_msda_inputs(EXPORT_SHAPES, n=2, lq=lq, heads=2, dim=4, points=3), opset)
    grid_samples = [n for n in model.graph.node if n.op_type == "GridSample"]
    assert (len(grid_samples) == 0) if sampler == "gather" else (len(grid_samples) == len(EXPORT_SHAPES))
    for i, (shapes, n, lq) in enumerate(RUN_SHAPES):
        args = random_msda_inputs(shapes, n=n, lq=lq, heads=2, dim=4, points=3, seed=10 + i)
        _close(_run(model, args), msda_reference(*args), 2e-6)


def test_torchscript_trace_is_savable_and_size_general():
    """torch.jit.trace (detectron2's tracing export) records the gather sampler in pieces with plain slices: the
    module saves, loads and is exact at other sizes and batches (the ONNX exporter's one-Slice pieces are a Python
    Function, which a saved TorchScript module could not hold)."""
    lq = sum(h * w for h, w in EXPORT_SHAPES)
    args = random_msda_inputs(EXPORT_SHAPES, n=2, lq=lq, heads=2, dim=4, points=3)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(_Core(), args, check_trace=False), buf)
    buf.seek(0)
    traced = torch.jit.load(buf)
    for i, (shapes, n, _) in enumerate(RUN_SHAPES):
        args = random_msda_inputs(shapes, n=n, lq=sum(h * w for h, w in shapes), heads=2, dim=4, points=3, seed=20 + i)
        _close(traced(*args), msda_reference(*args), 2e-6)


def test_only_self_attention_is_gathered_in_pieces():
    """Queries that are the value's own tokens (Lq = S, an encoder) grow with the image and are gathered in pieces;
    a decoder's fixed query count is not."""
    from d2export.ops.msda import _self_attention

    assert _self_attention(32, 32) and not _self_attention(40, 32)
    assert _self_attention(torch.tensor(7), torch.tensor(7))  # traced sizes


def test_auto_exports_gather_unless_told_otherwise():
    args = random_msda_inputs(EXPORT_SHAPES, n=1, lq=3, heads=2, dim=4, points=2)
    ops = {n.op_type for n in _export(_Core(), args, 17).graph.node}
    assert "GridSample" not in ops and "Gather" in ops and "MatMul" in ops
    with use_sampler("grid_sample"):
        assert "GridSample" in {n.op_type for n in _export(_Core(), args, 17).graph.node}
    assert resolve_sampler("auto") == "pytorch"  # the context is left


def test_trt_plugin_node():
    args = random_msda_inputs(EXPORT_SHAPES, n=1, lq=3, heads=2, dim=4, points=2)
    buf = io.BytesIO()
    torch.onnx.export(_Core("trt_plugin"), args, buf, input_names=NAMES, output_names=["out"], opset_version=17,
                      dynamo=False)
    graph = onnx.load_from_string(buf.getvalue()).graph
    plugin = [n for n in graph.node if n.op_type == "MultiscaleDeformableAttnPlugin_TRT"]
    assert len(plugin) == 1 and not plugin[0].attribute
    producers = {o: n for n in graph.node for o in n.output}
    inputs = list(plugin[0].input)
    assert inputs[0] == "value" and inputs[3:] == ["sampling_locations", "attention_weights"]
    for name, source in zip(inputs[1:3], ["spatial_shapes", "level_start_index"]):  # int32, as the plugin wants
        cast = producers[name]
        assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.INT32 and cast.input[0] == source


@pytest.mark.parametrize("sampler", EAGER)
def test_autocast_computes_in_float32(sampler):
    """Under autocast (CPU bfloat16 here, CUDA float16 alike) the core's MatMul must not drop to half precision: the
    inputs are float32, so is the arithmetic."""
    args = random_msda_inputs([(16, 24), (8, 12)], n=2, lq=30, heads=2, dim=8, points=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = multi_scale_deformable_attention(*args, sampler=sampler)
    assert out.dtype == torch.float32
    _close(out, msda_reference(*args), 1e-5)
