"""The fused MSDA operator as an OpenVINO extension (d2export/kernels/openvino_extension.py, native/msda_openvino.cc):
built on first use, read by OpenVINO's ONNX frontend, computing what onnxruntime's native kernel computes."""
import io
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

from d2export.kernels import custom_ops, native_build, openvino_extension
from d2export.ops.msda import multi_scale_deformable_attention
from d2export.runtime.openvino_session import OpenVINOSession
from msda_reference import edge_locations, msda_reference, random_msda_inputs

NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]
CASES = [  # (level shapes, batch, queries, heads, dim, points): sizes other than exported, batches, non-square levels
    ([(6, 5), (3, 3)], 2, 7, 2, 4, 3),
    ([(9, 4), (5, 2), (1, 3)], 3, 11, 2, 8, 3),
    ([(4, 13), (2, 7)], 1, 40, 2, 4, 3),
    ([(1, 1), (2, 1)], 2, 5, 2, 4, 3),
]


class _Core(torch.nn.Module):
    def forward(self, *args):
        return multi_scale_deformable_attention(*args, sampler="fused")


@pytest.fixture(scope="module")
def fused_graph(tmp_path_factory) -> str:
    """One fused MSDA node, every axis dynamic, as a file (OpenVINO reads files)."""
    args = random_msda_inputs([(6, 5), (3, 3)], n=1, lq=5, heads=2, dim=4, points=3)
    buf = io.BytesIO()
    axes = {n: {i: f"{n}_{i}" for i in range(a.dim())} for n, a in zip(NAMES, args)}
    torch.onnx.export(_Core(), args, buf, input_names=NAMES, output_names=["out"], opset_version=17,
                      dynamic_axes=axes, dynamo=False)
    path = tmp_path_factory.mktemp("fused") / "msda.onnx"
    path.write_bytes(buf.getvalue())
    return str(path)


# OpenVINO (the Predictor's OpenVINO session, in float32) runs in a child process: its thread pools, and the extension
# it loads, stay out of the test worker (a pytest-xdist worker that had served OpenVINO graphs died later in the run,
# on an AMX Xeon)
_CHILD = """
import sys, numpy as np
from d2export.runtime.openvino_session import OpenVINOSession
session = OpenVINOSession(sys.argv[1], "f32", threads=2)
names = [o.name for o in session.get_outputs()]
np.savez(sys.argv[3], *session.run(names, dict(np.load(sys.argv[2]))))
"""


def _openvino_outputs(path, feeds: dict, tmp_path) -> list:
    """The graph at `path` run by OpenVINO with d2export's extension on `feeds`: its outputs in the graph's order
    (RuntimeError: what OpenVINO said)."""
    np.savez(tmp_path / "feeds.npz", **feeds)
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tmp_path / "feeds.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(done.stderr)
    with np.load(tmp_path / "out.npz") as out:
        return [out[f"arr_{i}"] for i in range(len(out.files))]


def _openvino(path, feeds: dict, tmp_path) -> np.ndarray:
    return _openvino_outputs(path, feeds, tmp_path)[0]


def _onnxruntime(path: str):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    custom_ops.register(options, [custom_ops.FUSED_MSDA_ID])
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_openvino_runs_the_rows_onnxruntime_runs(fused_graph, case, tmp_path):
    """Locations in and far out of range (-0.3..1.3), batches, non-square and 1-pixel levels: OpenVINO's output is
    onnxruntime's native kernel's, bit for bit (the same rows), and both are the float64 reference's within float32
    rounding."""
    shapes, n, lq, heads, dim, points = CASES[case]
    args = random_msda_inputs(shapes, n=n, lq=lq, heads=heads, dim=dim, points=points, lo=-0.3, hi=1.3, seed=40 + case)
    feeds = {name: a.numpy() for name, a in zip(NAMES, args)}
    got = _openvino(fused_graph, feeds, tmp_path)
    with custom_ops.forcing("native"):
        native = _onnxruntime(fused_graph).run(None, feeds)[0]
    reference = msda_reference(*args).numpy()
    assert got.shape == reference.shape and got.dtype == np.float32
    assert np.abs(got.astype(np.float64) - reference).max() < 2e-6
    np.testing.assert_array_equal(got, native)


def test_openvino_samples_pixel_edges_and_far_outside_as_the_reference(fused_graph, tmp_path):
    h, w = 3, 4
    grid = edge_locations(h, w)
    value, shapes, starts, _, _ = random_msda_inputs([(h, w)], n=1, heads=1, dim=3, points=1)
    attn = torch.rand(1, grid.shape[1], 1, 1, 1, generator=torch.Generator().manual_seed(3))
    args = (value, shapes, starts, grid, attn)
    got = _openvino(fused_graph, {name: a.numpy() for name, a in zip(NAMES, args)}, tmp_path)
    assert np.abs(got.astype(np.float64) - msda_reference(*args).numpy()).max() < 1e-6


def test_a_wrong_row_kernel_is_told_apart(fused_graph, tmp_path):
    """The comparison above can fail: a graph whose sampling locations are moved by a tenth of a pixel at the
    finest level is off the reference by far more than the bound."""
    shapes, n, lq, heads, dim, points = CASES[0]
    args = random_msda_inputs(shapes, n=n, lq=lq, heads=heads, dim=dim, points=points, seed=40)
    moved = list(args)
    moved[3] = args[3] + 0.1 / 6
    got = _openvino(fused_graph, {name: a.numpy() for name, a in zip(NAMES, moved)}, tmp_path)
    assert np.abs(got.astype(np.float64) - msda_reference(*args).numpy()).max() > 1e-3


def test_bad_shapes_are_named_as_onnxruntime_names_them(fused_graph, tmp_path):
    args = random_msda_inputs([(5, 4), (2, 2)], n=2, lq=6, heads=2, dim=8, points=2)
    feeds = {name: a.numpy() for name, a in zip(NAMES, args)}
    feeds["value"] = feeds["value"][:, :10]
    with pytest.raises(RuntimeError, match=r"MSDA: the levels \[\[5, 4\], \[2, 2\]\] need more tokens than value has"):
        _openvino(fused_graph, feeds, tmp_path)


def test_the_extension_is_built_once_and_refused_in_one_line_without_a_compiler(tmp_path, monkeypatch):
    first = openvino_extension.library()
    assert openvino_extension.library() == first  # cached: no second build
    monkeypatch.setenv(openvino_extension.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    with pytest.raises(openvino_extension.ExtensionUnavailable, match=r"no C\+\+ compiler.*export.sampler=gather") as e:
        openvino_extension.library()
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []  # nothing half-written


def test_a_fused_spotter_served_by_openvino_in_float32_is_onnxruntime_s(fused_export, tmp_path):
    """The tiny spotter's fused graph, run by OpenVINO and by onnxruntime on a batch of two: within float32
    verification's tolerances, ids equal."""
    from d2export.runtime.processing import Processing

    manifest, path = fused_export
    options = ort.SessionOptions()
    custom_ops.register(options, manifest.custom_ops)
    theirs = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    processing = Processing(manifest)
    rng = np.random.default_rng(8)
    pictures = [rng.integers(0, 255, (160, 224, 3), dtype=np.uint8) for _ in range(2)]
    feeds = processing.feeds([processing.prepare(p, "RGB") for p in pictures])
    names = [o.name for o in theirs.get_outputs()]
    for name, want, got in zip(names, theirs.run(names, feeds), _openvino_outputs(path, feeds, tmp_path)):
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.fixture(scope="module")
def fused_export(tmp_path_factory):
    from exports import export

    out = tmp_path_factory.mktemp("fused_spotter")
    manifest = export("textdet_tiny", out, "export.sampler=fused", "export.lint=false")
    return manifest, out / manifest.model_file


def test_a_graph_without_the_operator_needs_no_extension(tiny_export, monkeypatch):
    def refuse():
        raise AssertionError("the extension was asked for")

    monkeypatch.setattr(openvino_extension, "library", refuse)
    _, manifest, path = tiny_export  # the gather sampler
    assert manifest.sampler == "gather"
    OpenVINOSession(path, "f32", threads=1)
