"""Verification of detections sorted by score: slots whose scores tie may swap between onnxruntime and PyTorch (a
RetinaNet R-50 did at two of five sizes), which is no disagreement; any other difference still is."""
from __future__ import annotations

import numpy as np

from d2export.verification.comparison import Case, run_cases

NAMES = ["boxes", "scores", "labels"]


class Answers:
    """A stand-in onnxruntime session that answers with fixed outputs."""

    def __init__(self, outputs: dict[str, np.ndarray]):
        self.outputs = outputs

    def run(self, names, feeds):
        return [self.outputs[n] for n in names]


def detections(seed: int = 0, k: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    scores = np.sort(rng.uniform(0.1, 0.9, (1, k)).astype(np.float32))[:, ::-1].copy()
    scores[0, 3] = scores[0, 2]  # a tie
    return {"boxes": rng.uniform(0, 300, (1, k, 4)).astype(np.float32), "scores": scores,
            "labels": rng.integers(0, 80, (1, k))}


def swapped(outputs: dict[str, np.ndarray], i: int, j: int) -> dict[str, np.ndarray]:
    out = {n: v.copy() for n, v in outputs.items()}
    for v in out.values():
        v[0, [i, j]] = v[0, [j, i]]
    return out


def verdict(expected, actual, sorted_by):
    case = Case("case", {}, [expected[n] for n in NAMES])
    return {r.output: r.ok for r in run_cases(Answers(actual), NAMES, [case], 1e-4, 1e-4, 0.0, sorted_by)}


def test_tied_slots_may_swap_when_outputs_are_sorted_by_score():
    expected = detections()
    tie = swapped(expected, 2, 3)
    assert verdict(expected, tie, "scores") == {"boxes": True, "scores": True, "labels": True}
    assert verdict(expected, tie, None) == {"boxes": False, "scores": True, "labels": False}  # compared by position


def test_untied_swaps_and_changed_detections_still_fail():
    expected = detections()
    assert not verdict(expected, swapped(expected, 0, 5), "scores")["scores"]  # order by score broken
    moved = {n: v.copy() for n, v in expected.items()}
    moved["boxes"][0, 4, 2] += 1.0  # one box corner a pixel off
    assert verdict(expected, moved, "scores") == {"boxes": False, "scores": True, "labels": True}
    relabelled = {n: v.copy() for n, v in expected.items()}
    relabelled["labels"][0, 1] += 1
    assert verdict(expected, relabelled, "scores")["labels"] is False


def test_verification_sessions_run_on_as_many_threads_as_torch(tmp_path):
    """The graph is checked on torch's threads (every core, or what OMP_NUM_THREADS / torch.set_num_threads asked),
    not onnxruntime's every core: an export limited to one thread stays on one."""
    import onnx
    import torch
    from onnx import TensorProto, helper

    from d2export.verification import check_sessions

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "identity.onnx"
    onnx.save(helper.make_model(graph), str(path))
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert check_sessions.session_options(path).intra_op_num_threads == threads
    finally:
        torch.set_num_threads(before)
