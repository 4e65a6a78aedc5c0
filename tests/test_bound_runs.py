"""CUDA graphs in serving, as far as a machine without a GPU can check them: the fixed-buffer runner
(d2export/runtime/bound_runs.py) on CPU buffers, and the Predictor's fallback (`cuda_graph=True` where onnxruntime
runs on the CPU: one line in the log, the same predictions)."""
import logging

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from d2export.runtime.bound_runs import GRAPH_ID, BoundRuns


@pytest.fixture(scope="module")
def affine(tmp_path_factory):
    """y = 2x + 1 and s = sum(x) over any (n, k) float32 x: a session to run by hand."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "k"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "k"])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    two, one = (helper.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in (("two", 2.0), ("one", 1.0)))
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "one"], ["y"]),
                               helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)],
                              "affine", [x], [y, s], initializer=[two, one])
    path = tmp_path_factory.mktemp("bound") / "affine.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_each_call_gets_its_own_answer_from_the_shared_buffers(affine):
    runs = BoundRuns(affine, ["y", "s"], device="cpu", graphs=False)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    first = runs.run({"x": a})
    second = runs.run({"x": b})
    np.testing.assert_array_equal(first["y"], 2 * a + 1)  # not overwritten by the second run
    np.testing.assert_array_equal(second["y"], 2 * b + 1)
    np.testing.assert_allclose(second["s"], b.sum(), rtol=1e-6)
    assert runs.shapes == 1
    third = runs.run({"x": a[:, :2].copy()})  # another shape: buffers (and a graph id) of its own
    np.testing.assert_array_equal(third["y"], 2 * a[:, :2] + 1)
    np.testing.assert_array_equal(runs.run({"x": b})["y"], 2 * b + 1)
    assert runs.shapes == 2


def test_each_shape_replays_its_own_graph(affine):
    runs = BoundRuns(affine, ["y", "s"], device="cpu", graphs=True)
    x = np.ones((1, 4), np.float32)
    runs.run({"x": x})
    runs.run({"x": np.ones((2, 4), np.float32)})
    runs.run({"x": x})
    ids = [slot.run_options.get_run_config_entry(GRAPH_ID) for slot in runs._slots.values()]
    assert ids == ["0", "1"]


def test_asked_for_cuda_graphs_on_the_cpu_the_predictor_says_so_and_serves_the_same(tiny_export, caplog):
    from d2export.runtime.predictor import Predictor
    from d2export.runtime.serving_arguments import add_predictor_arguments

    _, _, path = tiny_export
    picture = np.random.default_rng(3).integers(0, 255, (150, 210, 3), np.uint8)
    plain = Predictor(path).predict(picture)
    with caplog.at_level(logging.WARNING, logger="d2export"):
        asked = Predictor(path, cuda_graph=True)
    assert [r.message for r in caplog.records if "cuda graphs" in r.message] == [
        "cuda graphs: not used: they need the CUDA provider (the session runs on CPUExecutionProvider)"]
    assert asked.metadata()["cuda_graph"] is False
    again = asked.predict(picture)
    assert [i.score for i in again.instances] == [i.score for i in plain.instances]
    assert [i.text for i in again.instances] == [i.text for i in plain.instances]
    import argparse

    ap = argparse.ArgumentParser()
    add_predictor_arguments(ap)
    assert ap.parse_args(["m.onnx", "--providers", "cuda", "--cuda-graph"]).cuda_graph is True


def test_a_fixed_size_graph_serves_pictures_of_other_sizes(fixed_fused_export):
    """Resized to fit the graph (the longer side at most its shorter one), zero-padded to it: the graph's answer for
    that input, fed by hand."""
    from d2export.runtime.predictor import Predictor

    _, path = fixed_fused_export
    predictor = Predictor(path)
    assert predictor.fixed == (1, 160, 224)
    picture = np.random.default_rng(4).integers(0, 255, (150, 210, 3), np.uint8)
    prepared = predictor.prepare(picture)
    assert prepared.chw.shape == (3, 114, 160)  # 150x210 → shorter side 160 would make the longer 224 > 160
    images = np.zeros((1, 3, 160, 224), np.uint8)
    images[0, :, :114, :160] = prepared.chw
    by_hand = predictor.session.run(None, {"images": images, "image_sizes": np.array([[114, 160]], np.int64)})
    served = predictor.run([prepared])
    for name, expected in zip(predictor.output_names, by_hand):
        np.testing.assert_array_equal(served[name], expected)
    assert predictor.predict(picture).height == 150
    with pytest.raises(ValueError, match="at most 1 picture"):
        predictor.feeds([prepared, prepared])


def test_pad_batch_fills_a_fixed_batch_with_blank_pictures():
    from d2export.resizing import pad_batch

    image = np.full((3, 5, 7), 9, np.uint8)
    batch, sizes = pad_batch([image], (2, 8, 10))
    assert batch.shape == (2, 3, 8, 10) and sizes.tolist() == [[5, 7], [5, 7]]
    assert (batch[0, :, :5, :7] == 9).all() and batch[0].sum() == 9 * 3 * 5 * 7 and batch[1].sum() == 0
    with pytest.raises(ValueError, match="do not fit"):
        pad_batch([np.zeros((3, 9, 7), np.uint8)], (2, 8, 10))
