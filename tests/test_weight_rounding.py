"""export.int8_rounding=gptq: int8 weights rounded against the calibration pictures' activations, scales kept."""
import numpy as np
import pytest

from d2export.exporting import int8, weight_rounding
from exports import Feeds

K, N = 48, 12


MIXING = np.random.default_rng(2).normal(size=(6, K))


def _correlated(g, rows: int) -> np.ndarray:
    """Activations whose channels move together (a few factors, mixed alike in every draw), as a layer's do."""
    return (g.normal(size=(rows, 6)) @ MIXING + 0.1 * g.normal(size=(rows, K))).astype(np.float32)


def _nearest(w: np.ndarray, scale: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Rounding to the nearest step: QuantizeLinear's rule for symmetric int8 weights."""
    return np.clip(np.rint(w / scale), qmin, qmax)


def test_uncorrelated_activations_round_to_the_nearest_step():
    """With H diagonal no row's error can be carried onto another: GPTQ is plain rounding."""
    g = np.random.default_rng(3)
    w = g.normal(size=(K, N))
    scale = np.abs(w).max(0) / 64
    h = np.diag(g.uniform(0.5, 2.0, K))
    np.testing.assert_array_equal(weight_rounding.gptq(w, scale, h, -64, 64), _nearest(w, scale, -64, 64))


def _row_by_row(w, scale, h, qmin, qmax):
    """GPTQ as the paper states it, one row at a time over the rows in order of H's diagonal (largest first): each
    row's error over its pivot in the Cholesky factor of H⁻¹ is taken off every later row."""
    h = h + 0.01 * np.mean(np.diag(h)) * np.eye(len(h))
    order = np.argsort(-np.diag(h), kind="stable")
    w, h = w[order].copy(), h[np.ix_(order, order)]
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for k in range(len(w)):
        q[k] = np.clip(np.rint(w[k] / scale), qmin, qmax)
        w[k + 1:] -= np.outer(u[k, k + 1:], (w[k] - q[k] * scale) / u[k, k])
    out = np.zeros_like(q)
    out[order] = q
    return out


def test_blocks_of_rows_round_as_row_by_row_does():
    g = np.random.default_rng(5)
    rows = 2 * weight_rounding.BLOCK + 44  # two whole blocks and a part
    mixing = g.normal(size=(10, rows))
    x = g.normal(size=(3000, 10)) @ mixing + 0.1 * g.normal(size=(3000, rows))
    w = g.normal(size=(rows, 6))
    scale = np.abs(w).max(0) / 64
    q = weight_rounding.gptq(w, scale, x.T @ x, -64, 64)
    reference = _row_by_row(w, scale, x.T @ x, -64, 64)
    assert np.mean(q != reference) < 0.002  # float64 sums in another order may tip a rare half step
    assert np.mean(q != _nearest(w, scale, -64, 64)) > 0.05  # a case where carrying errors changes rows


def test_correlated_activations_move_the_product_less_than_nearest_rounding():
    g = np.random.default_rng(4)
    w = g.normal(size=(K, N))
    scale = np.abs(w).max(0) / 64
    x = _correlated(g, 2000).astype(np.float64)
    q = weight_rounding.gptq(w, scale, x.T @ x, -64, 64)
    assert q.dtype == np.int8 and q.min() >= -64 and q.max() <= 64
    held = _correlated(np.random.default_rng(40), 2000).astype(np.float64)  # activations it was not rounded on

    def error(integers):
        return np.linalg.norm(held @ w - held @ (integers * scale))

    assert error(q) < 0.7 * error(_nearest(w, scale, -64, 64))
    changed = np.mean(q != _nearest(w, scale, -64, 64))
    assert 0.05 < changed < 0.6  # a correction of the rounding, not another weight


def _two_products(tmp_path):
    """x [1, 64, K] -> MatMul by w [K, N] and Gemm by v [N, K] (transB) on the rows: both layouts of a weight."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(6)
    w, v = g.normal(size=(K, N)).astype(np.float32), g.normal(size=(N, K)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="/proj/MatMul"),
             helper.make_node("Reshape", ["x", "rows"], ["x2"], name="/flat/Reshape"),
             helper.make_node("Gemm", ["x2", "v"], ["z"], name="/head/Gemm", transB=1)]
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, N]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [64, N])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v"),
                               numpy_helper.from_array(np.array([64, K], np.int64), "rows")])
    src = tmp_path / "float.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    calibration = Feeds([{"x": _correlated(g, 64)[None]} for _ in range(8)])
    return src, w, v, calibration


def test_gptq_is_written_into_the_served_graph_and_its_products_lie_nearer_float(tmp_path):
    import onnxruntime as ort

    src, w, v, calibration = _two_products(tmp_path)
    x = _correlated(np.random.default_rng(41), 64)[None]  # activations it was not calibrated on
    errors = {}
    for rounding in ("nearest", "gptq"):
        dst = tmp_path / f"{rounding}.onnx"
        record = int8.quantize(src, dst, "static", (), ["avx2"], calibration, static_ops=("MatMul", "Gemm"),
                               rounding=rounding)
        assert record.rounding == rounding and record.reduce_range
        y, z = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        errors[rounding] = np.linalg.norm(y - x @ w), np.linalg.norm(z - x[0] @ v.T)
    assert record.calibration["gptq_weights"] == 2
    assert all(g < 0.9 * n for g, n in zip(errors["gptq"], errors["nearest"])), errors


def test_gptq_needs_static_int8():
    from d2export.config import ConfigError, load

    with pytest.raises(ConfigError, match="set export.int8=static"):
        load("textdet_tiny", ["export.int8=dynamic", "export.int8_rounding=gptq", "export.output_dir=/nonexistent"])
    with pytest.raises(ConfigError, match="choose one of nearest, gptq"):
        load("textdet_tiny", ["export.int8=static", "export.calibration=x", "export.int8_rounding=adaround",
                              "export.output_dir=/nonexistent"])


def test_a_convolutions_patches_times_its_weight_rows_is_the_convolution():
    """The rows H is made of: torch's conv2d (stride, asymmetric padding, dilation) as the reference."""
    import torch

    g = np.random.default_rng(8)
    x, w = g.normal(size=(2, 3, 11, 14)), g.normal(size=(5, 3, 3, 2))
    weight = weight_rounding.Weight("/c/Conv", "x", "w", "s", "conv", ((3, 2), (2, 1), (1, 0, 2, 1), (2, 1)))
    padded = torch.nn.functional.pad(torch.from_numpy(x), (0, 1, 1, 2))  # left, right, top, bottom
    y = torch.nn.functional.conv2d(padded, torch.from_numpy(w), stride=(2, 1), dilation=(2, 1)).numpy()
    rows = weight.patches(x) @ weight.rows(w)  # [positions, N], positions B-major then row-major
    np.testing.assert_allclose(rows, y.transpose(0, 2, 3, 1).reshape(-1, 5), atol=1e-9)
    np.testing.assert_array_equal(weight.stored(weight.rows(w), w.shape), w)


def test_gptq_rounds_a_convolution_nearer_float(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(9)
    w = g.normal(size=(8, 6, 3, 3)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="/conv/Conv", pads=[1, 1, 1, 1])],
                              "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [numpy_helper.from_array(w, "w")])
    src = tmp_path / "float.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    mixing = g.normal(size=(3, 6))

    def pictures(rng, count):  # channels that move together, smooth across space
        base = rng.normal(size=(count, 3, 12, 12))
        smooth = base + np.roll(base, 1, 2) + np.roll(base, 1, 3)
        return np.einsum("bfhw,fc->bchw", smooth, mixing).astype(np.float32)

    x = pictures(np.random.default_rng(42), 1)
    errors = {}
    for rounding in ("nearest", "gptq"):
        dst = tmp_path / f"{rounding}.onnx"
        record = int8.quantize(src, dst, "static", (), ["avx2"], Feeds([{"x": p[None]} for p in pictures(g, 8)]),
                               static_ops=("Conv",), rounding=rounding)
        y = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        expected = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        errors[rounding] = np.linalg.norm(y - expected)
    assert record.calibration["gptq_weights"] == 1
    assert errors["gptq"] < 0.9 * errors["nearest"], errors


def test_the_fused_spotter_rounded_by_gptq_verifies_and_records_it(text_pictures, tmp_path):
    """The activations come from the graph onnxruntime runs with d2export's fused operator registered; the family
    recipe's graph so rounded still holds int8's tensor tolerances."""
    from exports import export

    manifest = export("textdet_micro", tmp_path, "export.int8=static", "export.sampler=fused",
                      f"export.calibration={text_pictures}", "export.calibration_count=8", "verify.batch=false",
                      "export.lint=false", "export.int8_rounding=gptq")
    v = manifest.verification["int8"]
    assert manifest.precision == "int8" and v["passed"] is True
    q = v["quantization"]
    # one stored weight per quantised product, but a weight two calls of one module read is rounded once
    assert q["rounding"] == "gptq" and 20 < q["calibration"]["gptq_weights"] < q["quantized"]


def test_a_product_with_more_rows_than_gptq_takes_keeps_its_nearest_rounding(tmp_path, monkeypatch, caplog):
    import onnx
    from onnx import numpy_helper

    src, _, _, calibration = _two_products(tmp_path)
    monkeypatch.setattr(weight_rounding, "MAX_ROWS", K - 1)
    caplog.set_level("INFO", logger="d2export")
    graphs = {}
    for rounding in ("nearest", "gptq"):
        dst = tmp_path / f"{rounding}.onnx"
        record = int8.quantize(src, dst, "static", (), ["avx2"], calibration, static_ops=("MatMul", "Gemm"),
                               rounding=rounding)
        graphs[rounding] = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(dst)).graph.initializer}
    assert record.calibration["gptq_weights"] == 0 and "keep their nearest rounding: /proj/MatMul" in caplog.text
    assert graphs["gptq"].keys() == graphs["nearest"].keys()
    for name, value in graphs["nearest"].items():
        np.testing.assert_array_equal(graphs["gptq"][name], value)


def test_a_weight_two_products_read_is_rounded_once_for_both(tmp_path):
    """A module called twice (the character head on two decoder layers) stores one weight: it is rounded against
    both callers' activations, and both serve nearer float than with nearest rounding."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(10)
    w = g.normal(size=(K, N)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y"], name="/head/MatMul"),
             helper.make_node("MatMul", ["b", "w"], ["z"], name="/head_1/MatMul")]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 64, K])
                                                for n in "ab"],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 64, N]) for n in "yz"],
                              [numpy_helper.from_array(w, "w")])
    src = tmp_path / "float.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    calibration = Feeds([{"a": _correlated(g, 64)[None], "b": 2 * _correlated(g, 64)[None]} for _ in range(8)])
    held = np.random.default_rng(43)
    a, b = _correlated(held, 64)[None], 2 * _correlated(held, 64)[None]
    errors = {}
    for rounding in ("nearest", "gptq"):
        dst = tmp_path / f"{rounding}.onnx"
        record = int8.quantize(src, dst, "static", (), ["avx2"], calibration, static_ops=("MatMul",),
                               rounding=rounding)
        y, z = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"a": a, "b": b})
        errors[rounding] = np.linalg.norm(y - a @ w), np.linalg.norm(z - b @ w)
    assert record.calibration["gptq_weights"] == 1
    assert all(g < 0.9 * n for g, n in zip(errors["gptq"], errors["nearest"])), errors
