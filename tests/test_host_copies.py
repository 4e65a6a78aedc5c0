"""Host → device crossings of a graph served on a GPU, found here without one (d2export/verification/host_copies.py):
hand-made graphs whose answer is known, a dynamic export that has crossings, and a fixed-size fused export that
onnxruntime folds to none (each fused node's output sizes written by the exporter: without them every size after
the first MSDA was unknown and the shape arithmetic stayed), and its float16 copy."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from d2export.verification.host_copies import census, crossings, optimized


def _graph(nodes, inits=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], initializer=list(inits)))


def test_a_size_cast_to_float_and_multiplied_into_data_crosses_to_the_device():
    model = _graph([helper.make_node("Shape", ["x"], ["s"]),
                    helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
                    helper.make_node("Mul", ["x", "f"], ["y"], name="scale")])
    assert [(c.node, c.op, c.tensor, c.made_by) for c in crossings(model)] == [("scale", "Mul", "f", "Cast")]


def test_sizes_the_device_kernel_reads_from_host_memory_do_not_cross():
    """Shape → Gather → Concat with a constant → Reshape's shape: computed on the host, read there by the kernel."""
    minus_one = numpy_helper.from_array(np.array([-1], np.int64), "minus_one")
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    model = _graph([helper.make_node("Shape", ["x"], ["s"]),
                    helper.make_node("Gather", ["s", "zero"], ["n"]),
                    helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
                    helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0], np.int64))),
                    helper.make_node("Concat", ["n1", "minus_one"], ["shape"], axis=0),
                    helper.make_node("Reshape", ["x", "shape"], ["y"])], [minus_one, zero])
    model.graph.node.insert(0, model.graph.node.pop(3))  # the Constant first: nodes in topological order
    assert crossings(model) == []
    # the same size reaching data instead: one crossing
    model.graph.node.append(helper.make_node("Cast", ["n1"], ["nf"], to=TensorProto.FLOAT))
    model.graph.node.append(helper.make_node("Add", ["y", "nf"], ["z"], name="add"))
    assert [c.node for c in crossings(model)] == ["add"]


def test_a_dynamic_export_crosses_where_sizes_meet_the_sampling_arithmetic(tiny_export):
    _, _, path = tiny_export
    found = crossings(optimized(path))
    assert len(found) > 10
    assert {"Mul", "Div"} & {c.op for c in found}


def test_a_fixed_size_fused_export_leaves_no_shape_arithmetic_for_the_host(fixed_fused_export, tmp_path):
    """Verified at its size (the written output sizes are right), and onnxruntime folds every shape."""
    manifest, path = fixed_fused_export
    assert manifest.verification["passed"]
    assert sum(n.op_type == "Shape" for n in onnx.load(path, load_external_data=False).graph.node) > 0  # as exported
    figures = census(path)
    assert figures["shape_nodes"] == 0
    assert figures["host_to_device"] == 0
    # its float16 copy too (the fused node's output sizes kept through the conversion), the fused node in float32:
    # the CPU kernel, float32 only, runs it
    import onnxruntime as ort

    from d2export.exporting.fp16 import to_float16
    from d2export.verification.check_sessions import session_options

    half = tmp_path / "half.onnx"
    onnx.save(to_float16(onnx.load(path)), half)
    assert census(half)["host_to_device"] == 0 and census(half)["shape_nodes"] == 0
    session = ort.InferenceSession(str(half), session_options(half), providers=["CPUExecutionProvider"])
    feed = {"images": np.random.default_rng(5).integers(0, 255, (1, 3, 160, 224), np.uint8),
            "image_sizes": np.array([[160, 224]], np.int64)}
    scores = session.run(["scores"], feed)[0]
    assert scores.dtype == np.float32 and np.isfinite(scores).all()
