"""The near-tie diagnosis a failed verification carries: TopK selections whose candidates are closer than float
noise, measured on the failing inputs (exported ONNX graphs built here, expected gaps computed by hand)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from d2export.verification import near_ties
from d2export.verification.comparison import Case


def _topk_graph(path, k=3):
    nodes = [helper.make_node("Constant", [], ["k"], value=helper.make_tensor("kv", TensorProto.INT64, [1], [k])),
             helper.make_node("Relu", ["x"], ["scores"]),  # the selected tensor is internal, not an output
             helper.make_node("TopK", ["scores", "k"], ["top", "idx"], name="proposals")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
                              [helper.make_tensor_value_info("idx", TensorProto.INT64, ["n", k])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _case(name, rows):
    return Case(name, {"x": np.asarray(rows, np.float32)}, [])


def test_gaps_around_and_inside_the_selection_are_measured_on_each_case(tmp_path):
    path = _topk_graph(tmp_path / "m.onnx")
    clean = [[5, 4, 3, 2, 1, 0.5]]
    tied = [[5, 4, 3.00001, 3, 1, 0.5], [9, 8.5, 8.49999, 2, 1, 0.5]]  # row 2: a near-tie inside the selection
    copy = near_ties.SelectingCopy(path)
    found = {s.case: s for s in near_ties.selections(copy, [_case("clean", clean), _case("tied", tied)])}
    assert found["clean"].k == 3 and found["clean"].candidates == 6
    assert found["clean"].boundary_gap == pytest.approx(1.0, rel=1e-5)
    assert found["clean"].inner_gap == pytest.approx(1.0, rel=1e-5)
    assert not found["clean"].near_tied
    assert found["tied"].boundary_gap == pytest.approx(np.float32(3.00001) - 3.0)  # row 1; row 2's boundary is far
    assert found["tied"].inner_gap == pytest.approx(8.5 - np.float32(8.49999))  # row 2, inside the selection
    assert found["tied"].near_tied and found["tied"].inner_close == 1


def test_what_counts_as_tied_follows_the_graph_precision(tmp_path):
    path = _topk_graph(tmp_path / "m.onnx")
    rows = [[5, 4, 3.001, 3, 1, 0.5]]  # gap 1e-3 at values ~4: float16 noise, far above float32's
    copy = near_ties.SelectingCopy(path)
    assert not near_ties.selections(copy, [_case("c", rows)], precision="float32")[0].near_tied
    assert near_ties.selections(copy, [_case("c", rows)], precision="float16")[0].near_tied


def test_describe_names_the_node_and_case_or_says_nothing(tmp_path):
    path = _topk_graph(tmp_path / "m.onnx")
    copy = near_ties.SelectingCopy(path)
    message = near_ties.describe(copy, [_case("320x320", [[5, 4, 3.00001, 3, 1, 0.5]])])
    assert "near-tied selections" in message and "320x320: TopK proposals (k=3 of 6" in message
    assert near_ties.describe(copy, [_case("320x320", [[5, 4, 3, 2, 1, 0.5]])]) == ""


def test_graphs_without_selection_and_broken_inputs_never_hide_the_error(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "plain.onnx"))
    plain = near_ties.SelectingCopy(tmp_path / "plain.onnx")
    assert near_ties.selections(plain, [_case("c", [[1, 2, 3, 4, 5, 6]])]) == []
    broken = near_ties.describe(near_ties.SelectingCopy(_topk_graph(tmp_path / "m.onnx")),
                                [Case("c", {"wrong": np.zeros(1)}, [])])
    assert broken.startswith("(selections not checked:")
