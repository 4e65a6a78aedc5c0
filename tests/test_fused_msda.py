"""The fused MSDA operator (export.sampler=fused), its registration with onnxruntime, the chunked gather graph, and the
optimized-model session cache."""
import collections
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from d2export.manifest import Manifest, TensorSpec, manifest_path
from d2export.ops.msda import QUERY_CHUNKS, multi_scale_deformable_attention
from d2export.kernels import custom_ops
from d2export.kernels.numba_msda import msda as fused_kernel
from msda_reference import edge_locations, msda_reference, random_msda_inputs
from exports import export

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]
EXPORT_SHAPES = [(6, 5), (3, 3)]


class _Core(torch.nn.Module):
    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def forward(self, *args):
        return multi_scale_deformable_attention(*args, sampler=self.sampler)


def _export(sampler, args, opset=17) -> bytes:
    """The graph of `sampler` (a name, or a module taking the five MSDA inputs), every axis dynamic."""
    buf = io.BytesIO()
    axes = {n: {i: f"{n}_{i}" for i in range(a.dim())} for n, a in zip(NAMES, args)}
    module = sampler if isinstance(sampler, torch.nn.Module) else _Core(sampler)
    torch.onnx.export(module, args, buf, input_names=NAMES, output_names=["out"], opset_version=opset,
                      dynamic_axes=axes, dynamo=False)
    return buf.getvalue()


def _session(model: bytes):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    custom_ops.register(options, custom_ops.graph_ops(onnx.load_from_string(model)))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run(session, args):
    return session.run(None, {n: a.numpy() for n, a in zip(NAMES, args)})[0]


def _max_err(out, ref) -> float:
    assert out.shape == tuple(ref.shape)
    return float(np.abs(out.astype(np.float64) - ref.numpy()).max())


RUN_CASES = [  # (level shapes, batch, queries, heads, dim, points): other sizes, level counts, batches than exported
    ([(6, 5), (3, 3)], 2, 7, 2, 4, 3),
    ([(9, 4), (5, 2), (1, 3)], 3, 11, 2, 4, 3),
    ([(4, 13), (2, 7)], 1, 40, 2, 4, 3),  # non-square, more queries than pixels
    ([(1, 1), (2, 1)], 2, 5, 2, 4, 3),  # 1-pixel levels
]


def test_fused_graph_is_one_node_and_matches_float64_reference():
    model = _export("fused", random_msda_inputs(EXPORT_SHAPES, n=1, lq=5, heads=2, dim=4, points=3))
    graph = onnx.load_from_string(model).graph
    fused = [n for n in graph.node if n.domain == custom_ops.DOMAIN]
    assert [n.op_type for n in fused] == [custom_ops.FUSED_MSDA]
    assert not {"Gather", "GridSample", "MatMul"} & {n.op_type for n in graph.node}
    assert custom_ops.graph_ops(onnx.load_from_string(model)) == [custom_ops.FUSED_MSDA_ID]
    session = _session(model)
    for i, (shapes, n, lq, heads, dim, points) in enumerate(RUN_CASES):
        args = random_msda_inputs(shapes, n=n, lq=lq, heads=heads, dim=dim, points=points, lo=-0.3, hi=1.3,
                                  seed=20 + i)
        assert _max_err(_run(session, args), msda_reference(*args)) < 2e-6


def test_fused_kernel_at_pixel_edges_and_far_outside():
    h, w = 3, 4
    grid = edge_locations(h, w)
    value, shapes, starts, _, _ = random_msda_inputs([(h, w)], n=1, heads=1, dim=3, points=1)
    attn = torch.rand(1, grid.shape[1], 1, 1, 1)
    args = (value, shapes, starts, grid, attn)
    out = fused_kernel(*(a.numpy() for a in args))
    assert _max_err(out, msda_reference(*args)) < 1e-6


def test_fused_kernel_takes_half_inputs_and_names_bad_shapes():
    args = random_msda_inputs([(5, 4), (2, 2)], n=2, lq=6, heads=2, dim=8, points=2)
    half = [a.half() if a.is_floating_point() else a for a in args]
    out = fused_kernel(*(a.numpy() for a in half))
    assert out.dtype == np.float32
    assert _max_err(out, msda_reference(*half)) < 1e-5
    with pytest.raises(ValueError, match="more tokens than value has"):
        fused_kernel(args[0][:, :10].numpy(), *(a.numpy() for a in args[1:]))
    with pytest.raises(ValueError, match="do not match"):
        fused_kernel(args[0].numpy(), args[1].numpy(), args[2].numpy(), args[3][..., :1].numpy(), args[4].numpy())


def test_fused_eager_side_is_the_gather_formulation():
    args = random_msda_inputs(EXPORT_SHAPES, n=2, lq=9, heads=2, dim=4, points=3, dtype=torch.float64)
    out = multi_scale_deformable_attention(*args, sampler="fused")
    assert out.dtype == torch.float64
    assert torch.equal(out, multi_scale_deformable_attention(*args, sampler="gather"))


def test_register_needs_nothing_for_portable_graphs_and_refuses_unknown_ops():
    options = ort.SessionOptions()
    assert custom_ops.register(options, []) is options
    with pytest.raises(ValueError, match="d2export.Nope"):
        custom_ops.register(ort.SessionOptions(), ["d2export.Nope"])
    with pytest.raises(RuntimeError):  # portable graphs keep onnxruntime's own spinning default
        options.get_session_config_entry("session.intra_op.allow_spinning")


def test_register_stops_pool_spinning_unless_the_caller_chose(monkeypatch):
    monkeypatch.setenv(custom_ops.KERNEL_ENV, "numba")  # the native kernel runs on the pool itself: spinning stays
    fused = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
    assert fused.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    chosen = ort.SessionOptions()
    chosen.add_session_config_entry("session.intra_op.allow_spinning", "1")
    custom_ops.register(chosen, [custom_ops.FUSED_MSDA_ID])
    assert chosen.get_session_config_entry("session.intra_op.allow_spinning") == "1"


_BLOCKED = """
import sys
sys.modules["onnxruntime_extensions"] = None  # as if the `fused` extra were not installed
from d2export.kernels import custom_ops
import onnxruntime as ort
assert custom_ops.register(ort.SessionOptions(), []) is not None  # portable graphs never need it
try:
    custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
except custom_ops.MissingExtra as e:
    print(e)
assert "torch" not in sys.modules
"""


def test_missing_extra_is_one_clear_line():
    done = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT), custom_ops.KERNEL_ENV: "numba"})
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert len(message.splitlines()) == 1
    assert "pip install 'd2export[fused]'" in message and "onnxruntime_extensions" in message


_TORCH_FREE = """
import sys
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto as T, helper
from d2export.kernels import custom_ops
from d2export.kernels.numba_msda import msda
types = [T.FLOAT, T.INT64, T.INT64, T.FLOAT, T.FLOAT]
names = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]
node = helper.make_node(custom_ops.FUSED_MSDA, names, ["out"], domain=custom_ops.DOMAIN)
graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, [None] * r)
                                        for n, t, r in zip(names, types, [4, 2, 1, 6, 5])],
                          [helper.make_tensor_value_info("out", T.FLOAT, [None] * 3)])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(custom_ops.DOMAIN, 1)])
options = custom_ops.register(ort.SessionOptions(), custom_ops.graph_ops(model))
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
feed = {"value": rng.standard_normal((2, 30, 2, 4), np.float32), "spatial_shapes": np.array([[5, 4], [2, 5]]),
        "level_start_index": np.array([0, 20]), "sampling_locations": rng.random((2, 6, 2, 2, 3, 2), np.float32),
        "attention_weights": rng.random((2, 6, 2, 2, 3), np.float32)}
assert np.array_equal(session.run(None, feed)[0], msda(*feed.values()))
assert "torch" not in sys.modules
print("ok")
"""


def test_registered_operator_runs_without_importing_torch():
    """onnxruntime-extensions would import torch (2.4 s, ~650 MB) if it could; the runtime keeps it out (the numba
    kernel, which goes through it, forced: the native one loads no Python package at all)."""
    done = subprocess.run([sys.executable, "-c", _TORCH_FREE], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT), custom_ops.KERNEL_ENV: "numba"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _fake_model(folder: Path, ops) -> Path:
    """A one-node graph and its manifest: enough for the Triton writer and the session cache."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = folder / "model.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(path))
    Manifest("model.onnx", "text_spotter", [TensorSpec("x", "float32", ["batch", 3])],
             [TensorSpec("y", "float32", ["batch", 3])], 17, "torchscript", custom_ops=list(ops)
             ).write(manifest_path(path))
    return path


def test_triton_repository_of_8bit_int8_weights_says_which_cpus_serve_it(tmp_path, caplog):
    """Triton's onnxruntime backend is not asked for exact products: a graph with 8-bit int8 weights is written with
    a warning naming the CPUs it serves right on; 7-bit weights, any CPU, no warning."""
    from d2export.runtime.triton import write_repository

    path = _fake_model(tmp_path, [])
    manifest = Manifest.read(manifest_path(path))
    for reduce_range, warned in ((False, True), (True, False)):
        manifest.precision = "int8"
        manifest.verification = {"int8": {"quantization": {"reduce_range": reduce_range}}}
        manifest.write(manifest_path(path))
        caplog.clear()
        with caplog.at_level("WARNING", logger="d2export.runtime.triton"):
            write_repository(path, tmp_path / f"repo{reduce_range}")
        assert ("int8 weights use 8 bits: serve it on CPUs with VNNI or AMX" in caplog.text) == warned


def test_triton_repository_carries_the_native_operator_library(tmp_path):
    """A fused graph's repository holds the native library, and its config names it where the server will see the
    repository (Triton's protobuf parses it); the copied library alone, loaded as the onnxruntime backend loads it
    (no d2export, no Python kernel), runs a fused graph as the float64 reference computes it."""
    import importlib.util

    import tritonclient
    from google.protobuf import text_format

    from d2export.runtime.triton import OP_LIBRARY, main

    path = _fake_model(tmp_path, [custom_ops.FUSED_MSDA_ID])
    assert main([str(path), str(tmp_path / "repo"), "--name", "spotter", "--mount", "/models"]) == 0
    library = tmp_path / "repo" / "spotter" / OP_LIBRARY
    assert library.read_bytes() == Path(custom_ops.native_library()).read_bytes()
    spec = importlib.util.spec_from_file_location(
        "triton_model_config_pb2", Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py")
    pb2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb2)
    config = text_format.Parse((library.parent / "config.pbtxt").read_text(), pb2.ModelConfig())
    assert list(config.model_operations.op_library_filename) == [f"/models/spotter/{OP_LIBRARY}"]

    args = random_msda_inputs([(9, 4), (5, 2), (1, 3)], n=2, lq=7, heads=2, dim=4, points=3, seed=4)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(_export("fused", args), options, providers=["CPUExecutionProvider"])
    assert _max_err(_run(session, args), msda_reference(*args)) < 2e-6


def test_triton_repository_without_the_native_library_is_refused_in_one_line(tmp_path, monkeypatch):
    from d2export.runtime.triton import main, write_repository

    monkeypatch.setattr(custom_ops, "native_library", lambda: None)  # as where no compiler built it
    path = _fake_model(tmp_path, [custom_ops.FUSED_MSDA_ID])
    with pytest.raises(ValueError, match="native library.*export.sampler=gather"):
        write_repository(path, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    assert main([str(path), str(tmp_path / "repo")]) == 2
    with pytest.raises(ValueError, match="absolute path"):
        write_repository(_fake_model(tmp_path, []), tmp_path / "repo", mount="models")


def test_session_cache_opens_the_optimized_graph_and_survives_damage(tmp_path):
    from d2export.runtime.optimized_cache import cache_path, create_session

    path = _fake_model(tmp_path, [])
    x = {"x": np.array([[-1.0, 0.5, 2.0]], np.float32)}
    first = create_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    cached = cache_path(path, ort.SessionOptions())
    assert cached.is_file() and cached.parent.parent == tmp_path
    second = create_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert np.array_equal(first.run(None, x)[0], second.run(None, x)[0])
    cached.write_bytes(b"not a model")
    third = create_session(path, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert np.array_equal(third.run(None, x)[0], [[0.0, 0.5, 2.0]])
    onnx.load(str(cached))  # rewritten whole
    os.utime(path, ns=(1, 1))  # the model changed: another key
    assert cache_path(path, ort.SessionOptions()) != cached
    exact = ort.SessionOptions()  # so do the settings that change the optimised graph: int8's exact products
    exact.add_session_config_entry("session.x64quantprecision", "1")
    assert cache_path(path, exact) != cache_path(path, ort.SessionOptions())


# --- the chunked gather graph ---------------------------------------------------------------------------------
def _self_attention_args(shapes, n, seed=0):
    lq = sum(h * w for h, w in shapes)
    return random_msda_inputs(shapes, n=n, lq=lq, heads=2, dim=4, points=3, seed=seed)


def test_chunked_gather_graph_is_size_general_and_exact():
    """Self-attention (Lq = S) gathers in QUERY_CHUNKS pieces whose bounds follow Lq: the graph exported at two sizes
    is byte-identical, and it is exact at other sizes, batches and with pieces left empty (Lq < QUERY_CHUNKS)."""
    model = _export("gather", _self_attention_args([(6, 5), (3, 3)], n=1))
    assert model == _export("gather", _self_attention_args([(7, 9), (4, 5)], n=2, seed=1))
    gathers = [n for n in onnx.load_from_string(model).graph.node if n.op_type == "Gather"
               and n.input[0].startswith("/Reshape")]
    assert len(gathers) >= QUERY_CHUNKS
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for i, (shapes, n) in enumerate([([(9, 4), (5, 2)], 2), ([(2, 3), (1, 2)], 1), ([(13, 11), (7, 6)], 1)]):
        args = _self_attention_args(shapes, n, seed=30 + i)
        assert _max_err(_run(session, args), msda_reference(*args)) < 2e-6


class _EncoderAttention(torch.nn.Module):
    """An encoder's MSDA call: value, locations (some outside the image) and weights all computed from the tokens x
    [N, S, 8], so the queries are the value's own tokens in the program's shapes (Lq = S), as in a model."""

    def __init__(self, levels=2, heads=2, dim=4, points=3):
        super().__init__()
        self.shape = heads, dim, levels, points
        torch.manual_seed(0)
        self.value = torch.nn.Linear(8, heads * dim)
        self.locations = torch.nn.Linear(8, heads * levels * points * 2)
        self.weights = torch.nn.Linear(8, heads * levels * points)

    def inputs(self, x):
        (n, s, _), (m, d, levels, points) = x.shape, self.shape
        locations = torch.sigmoid(self.locations(x)).view(n, s, m, levels, points, 2) * 1.4 - 0.2
        weights = self.weights(x).view(n, s, m, levels * points).softmax(-1).view(n, s, m, levels, points)
        return self.value(x).view(n, s, m, d), locations, weights

    def forward(self, x, shapes, starts):
        value, locations, weights = self.inputs(x)
        return multi_scale_deformable_attention(value, shapes, starts, locations, weights, sampler="gather")


def test_under_torch_export_the_pieces_are_of_one_size_and_exact():
    """torch.export (export.exporter=dynamo): an encoder's queries in QUERY_CHUNKS pieces of one symbolic size, the
    last padded and the padding dropped (pieces whose sizes differ by one cost the tiny spotter's export 140 s of shape
    algebra); the program is exact at other sizes and batches, with pieces left empty."""
    def tokens(shapes, n, seed):
        shapes = torch.tensor(shapes)
        areas = shapes.prod(1)
        x = torch.randn(n, int(areas.sum()), 8, generator=torch.Generator().manual_seed(seed))
        return x, shapes, torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])

    module = _EncoderAttention()
    dims = ({0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("tokens", min=2)}, None, None)
    program = torch.export.export(module, tokens([(6, 5), (3, 3)], 2, 0), dynamic_shapes=dims)
    lookups = [n for n in program.graph.nodes if n.target == torch.ops.aten.embedding.default]
    assert len(lookups) == QUERY_CHUNKS and len({str(n.meta["val"].shape) for n in lookups}) == 1
    run = program.module()
    for i, (shapes, n) in enumerate([([(9, 4), (5, 2)], 2), ([(2, 3), (1, 2)], 1), ([(13, 11), (7, 6)], 3)]):
        x, shapes, starts = tokens(shapes, n, 40 + i)  # 46, 8 and 185 queries: none a multiple of 16
        with torch.no_grad():
            expected = msda_reference(module.inputs(x)[0], shapes, starts, *module.inputs(x)[1:])
            assert _max_err(run(x, shapes, starts).numpy(), expected) < 2e-6


def test_each_piece_of_the_chunked_gather_costs_four_nodes():
    """A piece is its rows' Slice, its weights' Slice, one Gather and one MatMul: the bounds are computed once, not
    with casts, unsqueezes and divisions per piece (which had been 2,285 of the R-50 spotter's 14,599 nodes)."""
    from d2export.ops.msda import _gather

    class Chunked(torch.nn.Module):
        def __init__(self, chunks):
            super().__init__()
            self.chunks = chunks

        def forward(self, *args):
            return _gather(*args, chunks=self.chunks)

    def node_count(chunks):
        model = _export(Chunked(chunks), _self_attention_args([(6, 5), (3, 3)], n=1))
        return collections.Counter(n.op_type for n in onnx.load_from_string(model).graph.node)

    few, many = node_count(4), node_count(12)
    extra = {op: many[op] - few[op] for op in many if many[op] != few[op]}
    assert extra == {"Slice": 16, "Gather": 8, "MatMul": 8}


# --- the whole pipeline with the fused operator ----------------------------------------------------------------
@pytest.fixture(scope="module")
def fused_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_export")
    manifest = export("textdet_tiny", out, "export.sampler=fused")
    return manifest, out / manifest.model_file


def test_fused_export_is_verified_and_named_in_the_manifest(fused_export):
    manifest, path = fused_export
    assert manifest.custom_ops == [custom_ops.FUSED_MSDA_ID]
    assert manifest.verification["passed"] is True
    # the kernel that computed the operator in verification: native, where a compiler built it (as here, in CI)
    assert manifest.verification["msda_kernel"] == ("native" if custom_ops.native_library() else "numba")
    assert json.loads(manifest_path(path).read_text())["custom_ops"] == [custom_ops.FUSED_MSDA_ID]
    nodes = onnx.load(str(path)).graph.node
    # one node per MSDA call; tiny: one encoder layer, one decoder layer with a location and a text branch
    assert sum(n.domain == custom_ops.DOMAIN for n in nodes) == 3


def test_predictor_registers_the_operator_and_matches_the_portable_graph(fused_export, tiny_export):
    from d2export.runtime import Predictor

    _, fused_path = fused_export
    _, _, portable_path = tiny_export
    rng = np.random.default_rng(5)
    image = rng.integers(0, 255, (150, 210, 3), dtype=np.uint8)
    fused, portable = Predictor(fused_path, threads=2), Predictor(portable_path, threads=2)
    # which kernel served it: native where setup.py built it, else numba
    assert fused.metadata()["msda_kernel"] == custom_ops.kernel().name and portable.metadata()["msda_kernel"] is None
    a, b = (p.run([p.prepare(image)]) for p in (fused, portable))
    np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-5)
    np.testing.assert_allclose(a["ctrl_points"], b["ctrl_points"], atol=1e-3)


def test_config_refuses_fused_where_it_cannot_run():
    from d2export.config import load

    with pytest.raises(ValueError, match="export.sampler=fused"):
        load("textdet_tiny", ["export.output_dir=/tmp/unused", "export.sampler=fused", "export.target=tensorrt"])


def test_float16_spotter_with_a_float16_fused_node_verifies(tmp_path):
    """export.fp16_fused=float16: the tiny spotter's float16 graph with its fused nodes float16 (value and output;
    locations and weights float32, made by the kept core) passes float16 verification at its usual tolerances, on
    the CPU kernel's float16 variant, and no Cast sits between value_proj, the node and output_proj."""
    # two sizes, no batch case, no lint: the test's time (all six default cases verified too, when written)
    manifest = export("textdet_tiny", tmp_path, "export.sampler=fused", "export.fp16=true",
                      "export.fp16_fused=float16", "verify.sizes=[[160,224],[128,288]]", "verify.batch=false",
                      "export.lint=false")
    assert manifest.precision == "float16" and manifest.verification["fp16"]["passed"] is True
    graph = onnx.load(str(tmp_path / manifest.model_file)).graph
    producers = {o: n for n in graph.node for o in n.output}
    consumers = collections.defaultdict(list)
    for n in graph.node:
        for name in n.input:
            consumers[name].append(n)
    fused = [n for n in graph.node if n.domain == custom_ops.DOMAIN]
    types = {v.name: v.type.tensor_type.elem_type for v in graph.value_info}
    assert len(fused) == 3 and all(types[n.output[0]] == onnx.TensorProto.FLOAT16 for n in fused)
    for node in fused:
        assert producers[node.input[0]].op_type != "Cast"
        assert all(c.op_type != "Cast" for c in consumers[node.output[0]])
        assert all(producers[name].op_type != "Cast" for name in node.input[3:])  # float32, made by the core
