"""float16 conversion of exported graphs: weights halve, kept nodes (MSDA sampling, Softmax) really compute in float32,
inputs and outputs keep their types; and the module scopes it relies on."""
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from d2export.exporting.fp16 import to_float16
from d2export.exporting.graph_scopes import msda_scopes, node_scope

torch.set_num_threads(1)


class _Attn(torch.nn.Module):
    """An MSDA-shaped module: projections as children, sampling arithmetic in its own scope."""

    def __init__(self):
        super().__init__()
        self.sampling_offsets = torch.nn.Linear(8, 8)
        self.output_proj = torch.nn.Linear(8, 8)

    def forward(self, q):
        o = self.sampling_offsets(q)
        # float16 has a spacing of 2 at 2048: this round trip loses up to 1 there, nothing in float32
        coord = (o + 2048.0) - 2048.0
        return self.output_proj(coord.softmax(-1) + coord)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.attn = _Attn()

    def forward(self, x):
        return self.attn(self.inp(x)), self.inp(x).softmax(-1)


def _export(net, x):
    buf = io.BytesIO()
    torch.onnx.export(net, (x,), buf, input_names=["x"], output_names=["y", "p"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}, "p": {0: "n"}})
    return onnx.load_from_string(buf.getvalue())


def _run(model, x):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        net.attn.sampling_offsets.weight.mul_(5)
    return net, _export(net, x)


def test_scopes(exported):
    _, model = exported
    assert msda_scopes(model.graph) == {"attn"}
    scopes = {node_scope(n) for n in model.graph.node}
    assert {"inp", "attn", "attn.sampling_offsets", "attn.output_proj"} <= scopes
    meta = helper.make_node("Add", ["a", "b"], ["c"], name="node_add_3")
    entry = meta.metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.name_scopes", "['', 'attn', 'attn.sampling_offsets', 'addmm_3']"
    assert node_scope(meta) == "attn.sampling_offsets"
    entry.value = "['', 'head', 'head.attn', 'sampling_offsets', 'linear_1']"  # a child called by a patched forward
    assert node_scope(meta) == "head.attn.sampling_offsets"


def test_weights_half_types_kept_and_kept_nodes_in_float32(exported):
    net, model = exported
    half = to_float16(model)
    onnx.checker.check_model(half, full_check=True)
    weights = [t for t in half.graph.initializer if t.dims and len(t.dims) == 2]
    assert weights and all(t.data_type == TensorProto.FLOAT16 for t in weights)
    assert [o.type.tensor_type.elem_type for o in half.graph.output] == [TensorProto.FLOAT] * 2
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    with torch.no_grad():
        ref = [t.double().numpy() for t in net.double()(torch.from_numpy(x).double())]
    net.float()
    y, p = _run(half, x)
    assert y.dtype == np.float32 and p.dtype == np.float32
    assert np.abs(y - ref[0]).max() < 0.05
    assert np.abs(p - ref[1]).max() < 2e-3
    # onnxruntime's CPU provider runs many float16 ops through float32 casts, so precision is checked on the types:
    # the kept scope's arithmetic reads float32, the rest float16 (and everything float16 when nothing is kept)
    assert _input_types(half, "attn") == {TensorProto.FLOAT}
    assert _input_types(half, "inp") == {TensorProto.FLOAT16}
    assert _input_types(to_float16(model, keep=lambda node: False), "attn") == {TensorProto.FLOAT16}


def _input_types(model, scope):
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.input]}
    types.update({t.name: t.data_type for t in inferred.initializer})
    return {types[i] for n in inferred.node if node_scope(n) == scope and n.op_type in ("Add", "Sub", "MatMul", "Gemm")
            for i in n.input if i in types}


def test_softmax_inputs_are_float32(exported):
    _, model = exported
    half = to_float16(model)
    producers = {o: n for n in half.graph.node for o in n.output}
    for node in half.graph.node:
        if node.op_type == "Softmax":
            src = producers[node.input[0]]
            assert (src.op_type == "Cast" and src.attribute[0].i == TensorProto.FLOAT) or node_scope(src) == "attn"


def test_keep_io_types_false_gives_float16_inputs_and_outputs(exported):
    net, model = exported
    half = to_float16(model, keep_io_types=False)
    onnx.checker.check_model(half, full_check=True)
    assert half.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    # y is made in float16; p by a Softmax, kept in float32, stays float32
    assert [o.type.tensor_type.elem_type for o in half.graph.output] == [TensorProto.FLOAT16, TensorProto.FLOAT]
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    y, p = ort.InferenceSession(half.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, {"x": x.astype(np.float16)})
    with torch.no_grad():
        ref = [t.double().numpy() for t in net.double()(torch.from_numpy(x).double())]
    net.float()
    assert y.dtype == np.float16 and p.dtype == np.float32 and np.abs(y - ref[0]).max() < 0.05 and np.abs(p - ref[1]).max() < 2e-3


def test_constants_are_clamped_to_the_float16_range():
    big = np.array([1e6, -1e6, 1e-30, -1e-30, 0.0, 1.5, np.inf], np.float32)
    graph = helper.make_graph([helper.make_node("Mul", ["x", "c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7])],
                              initializer=[onnx.numpy_helper.from_array(big, "c")])
    half = to_float16(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    c = onnx.numpy_helper.to_array(next(t for t in half.graph.initializer if t.name == "c"))
    assert c.dtype == np.float16
    assert c[0] == 65504 and c[1] == -65504  # not inf
    assert c[2] > 0 and c[3] < 0  # not flushed to zero
    assert c[4] == 0 and c[5] == 1.5 and np.isinf(c[6])


def _graph_with_if():
    """x * c, then an If whose branches read that product from the outer scope: (v + 2048) - 2048 (exact in float32,
    off by up to 1 in float16) or -v. torchvision's batched NMS exports such an If."""
    f = TensorProto.FLOAT
    branch = lambda name, nodes, out: helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, f, None)])
    then = branch("then", [helper.make_node("Add", ["v", "big"], ["w"]), helper.make_node("Sub", ["w", "big"], ["t"])],
                  "t")
    other = branch("else", [helper.make_node("Neg", ["v"], ["e"])], "e")
    nodes = [helper.make_node("Mul", ["x", "c"], ["v"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["positive"]),
             helper.make_node("If", ["positive"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4])],
                              [helper.make_tensor_value_info("y", f, [4])],
                              initializer=[onnx.numpy_helper.from_array(np.float32(v), n)
                                           for n, v in (("c", 3.0), ("big", 2048.0), ("zero", 0.0))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_if_branches_read_outer_tensors_in_float32():
    half = to_float16(_graph_with_if())
    onnx.checker.check_model(half, full_check=True)
    session = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([0.3, 1.7, 2.9, 0.11], np.float32)
    product = x.astype(np.float64) * 3  # 0.9, 5.1, 8.7, 0.33: float16 at 2048 (spacing 2) would be 0.33 to 0.9 off
    (y,) = session.run(None, {"x": x})
    assert y.dtype == np.float32 and np.abs(y - product).max() < 1e-2  # float16's rounding of x and v only
    (y,) = session.run(None, {"x": -x})
    assert np.abs(y - product).max() < 1e-2
    # the Mul became float16; the If is fed through a Cast, inside its branches
    mul = next(n for n in half.graph.node if n.op_type == "Mul")
    assert next(t for t in half.graph.initializer if t.name == mul.input[1]).data_type == TensorProto.FLOAT16
    branch = next(a.g for a in next(n for n in half.graph.node if n.op_type == "If").attribute if a.name == "then_branch")
    assert branch.node[0].input[0] == "v__as_fp32"


# --- the fused MSDA node -------------------------------------------------------------------------------------------
def _fused_graph():
    """An MSDA module's float32 graph with the fused operator, named as the TorchScript exporter names scopes:
    value_proj → masked fill (Where) → Reshape → fused → output_proj, locations and weights as graph inputs."""
    from d2export.kernels.custom_ops import DOMAIN, FUSED_MSDA

    rng = np.random.default_rng(3)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    init = lambda name, a: onnx.numpy_helper.from_array(np.asarray(a), name)  # noqa: E731
    weights = [init(n, rng.standard_normal((8, 8)).astype(np.float32) / 3) for n in ("wv", "wo", "wp")]
    mask = np.array([False, True, False, False, False, False]).reshape(1, 6, 1)
    constants = [init("zero", np.float32(0)), init("mask", mask),
                 init("shape", np.array([1, 6, 2, 4], np.int64)), init("levels", np.array([[2, 2], [1, 2]], np.int64)),
                 init("starts", np.array([0, 4], np.int64))]
    nodes = [helper.make_node("MatMul", ["x", "wv"], ["v"], name="/m/attn/value_proj/MatMul"),
             helper.make_node("Where", ["mask", "zero", "v"], ["vw"], name="/m/attn/Where"),
             helper.make_node("Reshape", ["vw", "shape"], ["value"], name="/m/attn/Reshape"),
             helper.make_node("MatMul", ["x", "wo"], ["offsets"], name="/m/attn/sampling_offsets/MatMul"),
             helper.make_node(FUSED_MSDA, ["value", "levels", "starts", "loc", "attn"], ["sampled"], domain=DOMAIN,
                              name="/m/attn/MultiScaleDeformableAttention"),
             helper.make_node("MatMul", ["sampled", "wp"], ["y"], name="/m/attn/output_proj/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, 6, 8]),
                                           helper.make_tensor_value_info("loc", f, [1, 3, 2, 2, 1, 2]),
                                           helper.make_tensor_value_info("attn", f, [1, 3, 2, 2, 1])],
                              [helper.make_tensor_value_info(name, f, None) for name in ("y", "offsets")],
                              initializer=weights + constants,
                              value_info=[helper.make_tensor_value_info("sampled", f, [1, 3, 8])])  # as exported
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    feed = {"x": rng.standard_normal((1, 6, 8)).astype(np.float32),
            "loc": rng.uniform(-0.2, 1.2, (1, 3, 2, 2, 1, 2)).astype(np.float32),
            "attn": rng.uniform(0, 1, (1, 3, 2, 2, 1)).astype(np.float32)}
    return helper.make_model(graph, opset_imports=opsets), feed


def _fused_run(model, feed):
    from d2export.kernels import custom_ops

    opts = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(["y"], feed)[0]


def test_fused_node_float32_by_default_and_float16_on_request():
    """Kept float32 by default (with its value chain); fused="float16": the node and the data movement around it
    float16 without a Cast between value_proj and output_proj, its locations and weights still float32."""
    model, feed = _fused_graph()
    producers = lambda m: {o: n for n in m.graph.node for o in n.output}  # noqa: E731

    kept = to_float16(model)
    fused = next(n for n in kept.graph.node if n.domain == "d2export")
    assert producers(kept)[fused.input[0]].op_type == "Reshape"  # the core's Reshape, float32
    assert producers(kept)[producers(kept)[fused.input[0]].input[0]].op_type == "Where"
    assert kept.graph.node[[n.name for n in kept.graph.node].index("/m/attn/output_proj/MatMul")].input[0] \
        .endswith("__as_fp16")

    half = to_float16(model, fused="float16")
    onnx.checker.check_model(half)
    nodes = {n.name: n for n in half.graph.node}
    fused = nodes["/m/attn/MultiScaleDeformableAttention"]
    assert list(fused.input) == ["value", "levels", "starts", "loc", "attn"]  # no Cast: value float16, loc float32
    assert nodes["/m/attn/Where"].input[2] == "v" and nodes["/m/attn/output_proj/MatMul"].input[0] == "sampled"
    assert next(t for t in half.graph.initializer if t.name == "zero").data_type == TensorProto.FLOAT16
    assert [v.type.tensor_type.elem_type for v in half.graph.value_info if v.name == "sampled"] == [TensorProto.FLOAT16]
    # a float16 graph's locations made in float16 are cast back to float32 for the node
    half_loc = to_float16(model, fused="float16", keep_io_types=False)
    assert list(next(n for n in half_loc.graph.node if n.domain == "d2export").input[3:]) == \
        ["loc__as_fp32", "attn__as_fp32"]

    want = _fused_run(model, feed).astype(np.float64)
    for graph in (kept, half):
        y = _fused_run(graph, feed)
        assert y.dtype == np.float32 and np.abs(y - want).max() < 0.05 * np.abs(want).max()
    with pytest.raises(ValueError, match="fused='half'"):
        to_float16(model, fused="half")
