"""Verification through near-tied selections (d2export/verification/pinning.py): a graph that picked differently only
among candidates within float noise passes, with the graph's pick imposed on eager; every wrong graph still fails.

Ties and faults are planted so that they fire only while the graph is traced (`torch.onnx.is_in_onnx_export()`):
eager PyTorch, the independent side, never sees them.
"""
from __future__ import annotations

import dataclasses

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from d2export import pipeline
from d2export.config import load
from d2export.verification import ladder, near_ties, pinning
from d2export.verification.comparison import Case, VerificationError, compare_case

FLOAT32 = pinning.Tolerances(atol=1e-3, rtol=1e-3, pixel_atol=1e-3)  # verify's defaults
TIGHT = pinning.Tolerances(atol=1e-5, rtol=1e-5, pixel_atol=1e-5)  # the two-stage module's comparison
QUANTUM = 0.25  # planted ties: proposal logits rounded to this step in eager and graph alike


def _pattern(n: int, dtype) -> torch.Tensor:
    """A fixed, traceable, non-monotonic pattern over n candidates: it breaks exact ties another way than eager."""
    return torch.sin(torch.arange(n, dtype=dtype) * 12.9898)


def plant_ties(module: nn.Module, graph_noise: float, shift: float = 0.0):
    """Proposal logits less `shift` rounded to QUANTUM (exact ties, in eager and in the graph) plus, in the graph
    only, `graph_noise` × a fixed pattern: below the near-tie bound it is another CPU's rounding; above it a real
    fault. (The shift moves no logit past another: the selection sees the same order.)"""

    def hook(_, __, out):
        out = torch.round((out - shift) / QUANTUM) * QUANTUM
        if torch.onnx.is_in_onnx_export():
            out = out + graph_noise * _pattern(out.shape[1], out.dtype)[None, :, None]
        return out

    return module.register_forward_hook(hook)


def while_tracing(module: nn.Module, change):
    """`change(output)` applied to `module`'s output in the graph only."""
    return module.register_forward_hook(lambda _, __, out: change(out) if torch.onnx.is_in_onnx_export() else out)


FAMILIES = {  # config → the module whose output the two-stage TopK selects from
    "textdet_tiny": "testr.transformer.bbox_class_embed",
    "dptext_tiny": "dptext_detr.transformer.bbox_class_embed",
    "deepsolo_tiny": "detection_transformer.transformer.bezier_class_embed",
    "dino_tiny": "transformer.decoder.class_embed.1",
}
SIZES = "verify.sizes=[[160,224],[128,288],[288,128]]"


def _built(config: str, tmp_path, *overrides: str):
    """Three verification sizes and a batch; no lint (a second trace, which these tests do not look at)."""
    return pipeline.prepare(load(config, [f"export.output_dir={tmp_path}", SIZES, "export.lint=false", *overrides]))


def _module(built, name: str) -> nn.Module:
    return dict(built.model.named_modules())[name]


@pytest.fixture
def no_ladder(monkeypatch):
    """The parity ladder (run on every failure) is not what these tests look at; it costs a second export."""
    monkeypatch.setattr(ladder, "_ladder_summary", lambda subject: {"culprit": None})


def _assert_pinned(verification: dict, precision_bound: float):
    pinned = verification["pinned"]
    assert verification["passed"] and pinned and all(p["ok"] for p in pinned)
    picks = [s for p in pinned for s in p["selections"]]
    assert any(s["positions"] > 0 for s in picks)  # the graph really picked differently
    assert all(s["gap"] <= s["bound"] <= precision_bound * max(1.0, 5.0) for s in picks)
    for p in pinned:  # after pinning, every output within the normal tolerance (atol 1e-3 + rtol 1e-3·|x|)
        assert p["max_abs_after_pinning"] and all(np.isfinite(v) for v in p["max_abs_after_pinning"].values())


# --- right graphs pass through pinning -----------------------------------------------------------------------------

@pytest.mark.parametrize("config", list(FAMILIES))
def test_graph_noise_below_the_bound_passes_by_pinning(config, tmp_path):
    built = _built(config, tmp_path)
    plant_ties(_module(built, FAMILIES[config]), graph_noise=1e-7)
    manifest = pipeline.export(built.cfg, built=built)
    _assert_pinned(manifest.verification, 1e-5)
    assert (tmp_path / manifest.model_file).exists()


def test_without_pinning_the_same_right_graph_is_refused(tmp_path, no_ladder):
    built = _built("textdet_tiny", tmp_path, "verify.pin_selections=false")
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=1e-7)
    with pytest.raises(VerificationError):
        pipeline.export(built.cfg, built=built)
    assert not list(tmp_path.glob("*.onnx"))


def test_float16_graph_with_ties_passes_by_pinning(tmp_path, text_pictures):
    # the trained spotter, whose scores are spread: a seeded one's all lie within float16's score tolerance of the
    # lists' cut, where any other pick is excused without pinning; on pictures of its domain (verify.pictures: on
    # noise pictures a reader's float16 characters move most, docs/verification.md). The noise is within float32's
    # tolerance and kept by float16 once the logits near the lists' cut (about 2.25) are moved to about 0, where
    # float16 resolves it (at 2.25 its step is 0.002: 9e-4 vanishes there, and 1e-7 everywhere). Rounding amplifies
    # float16's own error wherever a logit lies within it of a rounding boundary (a jump of a whole quantum, past
    # every tolerance: refused, rightly); unshifted, one of an earlier fixture's logits did, so the boundaries are moved
    built = _built("textdet_micro", tmp_path, "export.fp16=true", f"verify.pictures={text_pictures}")
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=9e-4, shift=2.25)
    manifest = pipeline.export(built.cfg, built=built)
    assert manifest.precision == "float16" and manifest.verification["fp16"]["passed"]
    pinned = manifest.verification["fp16"]["pinned"]  # the ties were met, and cleared by pinning
    assert pinned and all(p["ok"] for p in pinned) and any(s["positions"] > 0 for p in pinned for s in p["selections"])


# --- wrong graphs are refused, ties or not; the parity ladder names the faulty module ---------------------------------

def _refused(built) -> str:
    with pytest.raises(VerificationError) as error:
        pipeline.export(built.cfg, built=built)
    assert not list(Path(built.cfg.export.output_dir).glob("*.onnx"))  # nothing written
    return str(error.value)


def _culprit(message: str) -> str:
    found = re.search(r"the parity ladder's first diverging module: (\S+) at", message)
    assert found, message
    return found.group(1)


def test_real_divergence_that_looks_like_a_tie_is_refused(tmp_path):
    built = _built("textdet_tiny", tmp_path)
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=3 * QUANTUM)
    message = _refused(built)
    assert "past the tolerance of the outputs: not float noise" in message
    assert _culprit(message) == "model." + FAMILIES["textdet_tiny"]


def test_a_wrong_constant_after_the_selection_is_refused_even_with_a_tie(tmp_path):
    built = _built("textdet_tiny", tmp_path)
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=1e-7)
    while_tracing(_module(built, "testr.transformer.bbox_embed"), lambda out: out + 0.05)
    message = _refused(built)
    assert "still disagree" in message
    assert _culprit(message) == "model.testr.transformer.bbox_embed"  # seen through the tie


def test_a_perturbed_score_picked_far_outside_the_noise_is_refused(tmp_path):
    built = _built("textdet_tiny", tmp_path)
    # the graph lifts eager's lowest-scoring proposal to the top: a pick no float noise explains
    while_tracing(_module(built, FAMILIES["textdet_tiny"]),
                  lambda out: out + 50.0 * (out == out.min(dim=1, keepdim=True).values).to(out.dtype))
    message = _refused(built)
    assert "past the tolerance of the outputs: not float noise" in message
    assert _culprit(message) == "model." + FAMILIES["textdet_tiny"]


def test_a_tie_alone_is_reported_as_a_tie_by_the_ladder(tmp_path):
    built = _built("textdet_tiny", tmp_path)
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=1e-7)
    report = pipeline.ladder(built)
    assert report.culprit() is None
    assert any(c.ties and c.ties[0].positions > 0 for c in report.cases)
    text = report.format()
    assert "a near-tie, not a fault" in text and "no module diverges at any size" not in text


def test_a_selection_off_by_one_is_refused(tmp_path, no_ladder, monkeypatch):
    topk = torch.topk

    def shifted(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
        if not torch.onnx.is_in_onnx_export():
            return topk(x, k, dim=dim, largest=largest, sorted=sorted)
        values, indices = topk(x, k + 1, dim=dim, largest=largest, sorted=sorted)
        return values.narrow(dim, 1, k), indices.narrow(dim, 1, k)  # the best candidate dropped

    monkeypatch.setattr(torch, "topk", shifted)
    opened, real = [], near_ties.selecting_session
    monkeypatch.setattr(near_ties, "selecting_session", lambda path, *a: opened.append(path) or real(path, *a))
    message = _refused(_built("textdet_tiny", tmp_path))
    assert "does not select what eager selects" in message
    assert len(opened) == 1, opened  # the pinning and the near-tie lines read one copy of the graph


def test_two_outputs_swapped_are_refused_even_with_a_tie(tmp_path):
    built = _built("textdet_tiny", tmp_path)
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=1e-7)
    decode = built.adapter.decode

    def swapping(raw, sizes):
        out = list(decode(raw, sizes))
        if torch.onnx.is_in_onnx_export():
            out[0], out[4] = out[4][..., 0].contiguous(), out[0][..., None].expand_as(out[4]).contiguous()
        return tuple(out)

    built.adapter.decode = swapping
    message = _refused(built)
    assert "still disagree" in message
    assert _culprit(message) == "(outputs)"  # the head agrees through the tie; the adapter's outputs do not


# --- the mechanism, on a small two-stage module ------------------------------------------------------------------------

class TwoStage(nn.Module):
    """Scores every candidate, keeps the top k, returns their features in the picked order."""

    def __init__(self, k: int = 4, graph_noise: float = 0.0):
        super().__init__()
        self.k, self.graph_noise = k, graph_noise

    def forward(self, scores, features):
        if torch.onnx.is_in_onnx_export():
            scores = scores + self.graph_noise * _pattern(scores.shape[1], scores.dtype)[None]
        index = torch.topk(scores, self.k, dim=1)[1]
        return torch.gather(features, 1, index[..., None].expand(-1, -1, features.shape[-1])) * 2.0


def _two_stage_case(tmp_path, graph_noise: float, scores: np.ndarray):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    features = rng.normal(size=scores.shape + (3,)).astype(np.float32)
    path = tmp_path / "two_stage.onnx"
    torch.onnx.export(TwoStage(graph_noise=graph_noise), (torch.from_numpy(scores), torch.from_numpy(features)),
                      str(path), input_names=["scores", "features"], output_names=["picked"], opset_version=17,
                      dynamic_axes={"scores": {0: "n", 1: "c"}, "features": {0: "n", 1: "c"}}, dynamo=False)
    eager = TwoStage()
    rerun = lambda case: [eager(*(torch.from_numpy(case.inputs[n]) for n in ("scores", "features"))).numpy()]  # noqa
    inputs = {"scores": scores, "features": features}
    case = Case("case", inputs, rerun(Case("case", inputs, [])), images=[])
    actual = ort.InferenceSession(str(path)).run(None, inputs)
    judge = lambda name, e, a: (cs := compare_case(name, e, a, 1e-5, 1e-5), all(c.ok for c in cs))  # noqa: E731
    return path, case, rerun, judge, actual


def _tied_scores() -> np.ndarray:
    """Two batch rows, 12 candidates, blocks of exact ties across the k=4 boundary and inside the selection."""
    return np.array([[3, 3, 3, 1, 1, 2, 2, 0, 0, -1, 2, 3], [5, 4, 4, 4, 4, 1, 0, 0, 0, 0, 0, 0]], np.float32)


def test_pinning_clears_a_tie_the_graph_broke_another_way(tmp_path):
    path, case, rerun, judge, actual = _two_stage_case(tmp_path, 1e-7, _tied_scores())
    expected = case.expected[0]
    assert not np.allclose(actual[0], expected)  # the planted tie really changed the answer
    [result] = pinning.pin_cases(near_ties.SelectingCopy(path), [case], ["picked"], rerun, judge, TIGHT)
    assert result.ok, result.why
    assert result.picks and result.picks[0].positions > 0 and result.picks[0].gap == 0.0
    assert "picked differently; with the graph's selection every output agrees" in result.line()


def test_pinning_refuses_a_pick_outside_the_noise(tmp_path):
    scores = np.array([[3.0, 2.9, 2.8, 2.7, 2.6, 1.0, 0.5, 0.25]], np.float32)
    path, case, rerun, judge, _ = _two_stage_case(tmp_path, 0.3, scores)  # lifts candidate 5-ish: a real change
    [result] = pinning.pin_cases(near_ties.SelectingCopy(path), [case], ["picked"], rerun, judge, TIGHT)
    assert not result.ok and "not float noise" in result.why


def test_pinning_says_when_the_selections_agree(tmp_path):
    scores = np.array([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]], np.float32)
    path, case, rerun, _, actual = _two_stage_case(tmp_path, 0.0, scores)
    wrong = lambda name, e, a: (cs := compare_case(name, e, {"picked": a["picked"] + 1}, 1e-5, 1e-5),  # noqa: E731
                                all(c.ok for c in cs))
    [result] = pinning.pin_cases(near_ties.SelectingCopy(path), [case], ["picked"], rerun, wrong, TIGHT)
    assert not result.ok and "not a tie" in result.why


def test_a_pick_is_imposed_only_where_the_graphs_own_difference_from_eager_explains_it():
    x = torch.tensor([[1000.0, 1000.004, 999.0, 10.0]])
    # the graph saw 1000.003 and 1000.001: its own values put candidate 0 first, 0.004 below eager's pick
    graph = pinning._GraphPick("n", np.array([[1000.003, 1000.001, 999.0, 10.0]]), 1, 1, True, np.array([[0]]))
    with pinning.pinned_selections([graph], FLOAT32) as pinner:
        values, indices = torch.topk(x, 1, dim=1)
    assert indices.tolist() == [[0]] and values.tolist() == [[1000.0]]  # eager's value at the graph's pick
    found = pinner.found[0]
    assert found.tied and found.gap == pytest.approx(0.004, rel=1e-2) and found.bound == pytest.approx(0.006, rel=1e-2)
    # the same pick from values equal to eager's: nothing explains it (a wrong selection); eager keeps its own
    same = pinning._GraphPick("n", x.numpy().astype(np.float64), 1, 1, True, np.array([[0]]))
    with pinning.pinned_selections([same], FLOAT32) as pinner:
        _, indices = x.topk(1, dim=1)  # the Tensor method is pinned too
    assert indices.tolist() == [[1]] and not pinner.found[0].tied and pinner.found[0].bound == 0.0
    # values past the outputs' tolerance (1e-3 + 1e-3·|x|) explain nothing either
    far = pinning._GraphPick("n", np.array([[1003.0, 1000.004, 999.0, 10.0]]), 1, 1, True, np.array([[0]]))
    with pinning.pinned_selections([far], FLOAT32) as pinner:
        _, indices = torch.topk(x, 1, dim=1)
    assert indices.tolist() == [[1]] and "not float noise" in pinner.found[0].why


def test_a_corrupted_candidate_is_refused_under_reduced_precision_allowance():
    """Float16's tolerances let a fraction (`max_mismatch`) of candidates stand past the tolerance; a candidate the
    pick depends on never may. One of 100 proposals lifted by 50 to the top is 1% of them, under a 5% allowance."""
    float16 = pinning.Tolerances(0.05, 0.05, 0.05, max_mismatch=0.05)
    x = torch.linspace(0.0, 5.0, 100)[None]
    lifted = x.numpy().astype(np.float64).copy()
    lifted[0, 0] += 50.0  # eager's lowest, first in the graph
    graph = pinning._GraphPick("n", lifted, 1, 1, True, np.array([[0]]))
    with pinning.pinned_selections([graph], float16) as pinner:
        _, indices = torch.topk(x, 1, dim=1)
    assert indices.tolist() == [[99]] and "not float noise" in pinner.found[0].why
    # the allowance still spares candidates no pick depends on: an outlier elsewhere, a tie at the top broken
    tied = x.numpy().astype(np.float64).copy()
    tied[0, 98], tied[0, 99], tied[0, 10] = 5.0, 4.99, 30.0
    noisy = pinning._GraphPick("n", tied, 1, 1, True, np.array([[98]]))
    with pinning.pinned_selections([noisy], float16) as pinner:
        _, indices = torch.topk(torch.cat([x[:, :98], torch.tensor([[4.995, 5.0]])], 1), 1, dim=1)
    assert indices.tolist() == [[98]] and pinner.found[0].tied


def test_calls_of_another_signature_are_left_alone_and_topk_is_restored():
    original, method = torch.topk, torch.Tensor.topk
    other = torch.tensor([[5.0, 1.0, 3.0]])
    x = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    own = torch.topk(x, 2, dim=1)[1].tolist()[0]
    graph = pinning._GraphPick("n", x.numpy(), 2, 1, True, np.array([own[::-1]]))  # an exact tie ordered the other way
    with pinning.pinned_selections([graph], FLOAT32) as pinner:
        assert torch.topk(other, 2, dim=1)[1].tolist() == [[0, 2]]  # another shape: eager's own
        assert torch.topk(x, 2, dim=1)[1].tolist() == [own[::-1]]  # the graph's
    assert pinner.found and pinner.found[0].positions == 2 and pinner.found[0].gap == 0.0
    assert torch.topk is original and torch.Tensor.topk is method
    assert re.search(r"topk", str(torch.topk))


def test_an_argmax_is_pinned_as_a_topk_of_one_where_the_graphs_noise_explains_it():
    # per pixel the best of 3 classes (axis 1 of [N, C, H, W]), as a segmenter's map takes it; pixel (0, 1) near-tied
    x = torch.tensor([[[[0.5, 1e-8]], [[0.2, 1.0000001e-8]], [[0.1, 0.0]]]])
    graph = pinning._GraphPick("argmax", np.array([[[[0.5, 1.00000015e-8]], [[0.2, 1.0e-8]], [[0.1, 0.0]]]]), 1, 1,
                               True, np.array([[[[0, 0]]]]), "ArgMax")
    with pinning.pinned_selections([graph], FLOAT32) as pinner:
        assert torch.topk(x, 1, dim=1)[1].tolist() == [[[[0, 1]]]]  # a TopK of the same shape is not the ArgMax
        assert torch.argmax(x, 1).tolist() == [[[0, 0]]]  # the graph's pick, keepdim as asked
    assert pinner.found[0].tied and pinner.found[0].positions == 1
    with pinning.pinned_selections([graph], FLOAT32):
        assert x.argmax(1, keepdim=True).tolist() == [[[[0, 0]]]]  # the Tensor method too
        assert x.argmax().item() == 0  # no axis: not a selection the graph makes per row
    # a pick the values do not explain (class 2 at pixel 0: 0.4 below the best) is refused, eager keeps its own
    wrong = dataclasses.replace(graph, values=x.numpy().astype(np.float64), indices=np.array([[[[2, 1]]]]))
    with pinning.pinned_selections([wrong], FLOAT32) as pinner:
        assert torch.argmax(x, 1).tolist() == [[[0, 1]]]
    assert not pinner.found[0].tied
    assert torch.argmax is pinning_argmax and torch.Tensor.argmax is pinning_method


pinning_argmax, pinning_method = torch.argmax, torch.Tensor.argmax


# --- NMS: the graph's kept boxes, where greedy NMS on eager's values gives them once each may move by the noise ----

A, B, C = [0, 0, 10, 10], [1, 0, 11, 10], [20, 20, 30, 30]  # IoU(A, B) = 90/110; C overlaps neither


@pytest.mark.parametrize("keep, classes, gap, why", [
    ([0, 2], [0, 0, 0], 0.0, ""),  # greedy NMS's own answer
    ([1, 2], [0, 0, 0], 0.1, ""),  # B kept over A: needs A's 0.9 to fall to B's 0.8
    ([2, 0], [0, 0, 0], 0.2, ""),  # in rising score: 0.9 comes after 0.7
    ([0, 1, 2], [0, 1, 0], 0.0, ""),  # A and B of two classes do not suppress each other
    ([0, 1, 2], [0, 0, 0], np.inf, "two kept boxes of a class overlap"),
    ([0], [0, 0, 0], np.inf, "a dropped box overlaps no kept box"),  # C dropped with nothing over it
    ([0, 0, 2], [0, 0, 0], np.inf, "kept a candidate twice"),
    ([0, 3], [0, 0, 0], np.inf, "outside the candidates"),
])
def test_suppression_gap_against_hand_built_boxes(keep, classes, gap, why):
    boxes, scores = np.array([A, B, C], np.float64), np.array([0.9, 0.8, 0.7])
    found, reason = pinning._suppression_gap(boxes, scores, np.array(classes), 0.5, np.array(keep), shift=0.0)
    assert found == pytest.approx(gap) and (why in reason if why else reason == "")


def test_an_overlap_at_the_threshold_is_explained_only_by_coordinates_that_may_move():
    boxes = np.array([[0, 0, 10, 10], [4.99, 0, 14.99, 10]], np.float64)  # IoU 50.1/149.9 = 0.3342
    scores, classes, dropped = np.array([0.9, 0.8]), np.zeros(2), np.array([0])  # the graph suppressed the second
    assert "overlaps no kept box" in pinning._suppression_gap(boxes, scores, classes, 0.3345, dropped, shift=0.0)[1]
    # moved by 0.01 px, the boxes may overlap by 50.4/148.8 = 0.3387: past the threshold
    assert pinning._suppression_gap(boxes, scores, classes, 0.3345, dropped, shift=0.01) == (0.0, "")


class Suppress(nn.Module):
    """Batched NMS over given boxes; returns the kept boxes' features. In the graph only: scores moved by
    `graph_shift`, and another IoU threshold where `graph_threshold` is set."""

    def __init__(self, graph_shift=None, graph_threshold=None):
        super().__init__()
        self.graph_shift, self.graph_threshold = graph_shift, graph_threshold

    def forward(self, boxes, scores, classes, features):
        threshold = 0.5
        if torch.onnx.is_in_onnx_export():
            scores = scores + (self.graph_shift if self.graph_shift is not None else 0.0)
            threshold = self.graph_threshold or threshold
        return features[torchvision.ops.batched_nms(boxes, scores, classes, threshold)] * 2.0


def _suppression_case(tmp_path, model: Suppress):
    import onnxruntime as ort

    # two pairs overlapping past 0.5 whose scores differ by 1e-7 (a near-tie), one pair at IoU 0.43, classes 0/1
    boxes = torch.tensor([A, B, C, [21, 20, 31, 30], [40, 0, 50, 10], [44, 0, 54, 10]], dtype=torch.float32)
    scores = torch.tensor([0.5000001, 0.5, 0.30000001, 0.3, 0.6, 0.55])
    classes = torch.tensor([0, 0, 1, 1, 0, 0])
    features = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    inputs = {"boxes": boxes.numpy(), "scores": scores.numpy(), "classes": classes.numpy(),
              "features": features.numpy()}
    path = tmp_path / "suppress.onnx"
    torch.onnx.export(model, (boxes, scores, classes, features), str(path), input_names=list(inputs),
                      output_names=["kept"], opset_version=17, dynamo=False,
                      dynamic_axes={n: {0: "n"} for n in inputs} | {"kept": {0: "k"}})
    rerun = lambda case: [Suppress()(*(torch.from_numpy(case.inputs[n]) for n in inputs)).numpy()]  # noqa: E731
    case = Case("case", inputs, rerun(Case("case", inputs, [])), images=[])
    actual = ort.InferenceSession(str(path)).run(None, inputs)
    judge = lambda name, e, a: (cs := compare_case(name, e, a, 1e-5, 1e-5), all(c.ok for c in cs))  # noqa: E731
    return path, case, rerun, judge, actual


def test_nms_inside_the_graphs_if_branch_is_pinned_where_float_noise_explains_it(tmp_path):
    shift = torch.tensor([-2e-7, 0, -2e-7, 0, 0, 0])  # the graph's scores put B over A and D over C
    path, case, rerun, judge, actual = _suppression_case(tmp_path, Suppress(graph_shift=shift))
    assert actual[0].tolist() != case.expected[0].tolist()  # the graph really kept other boxes
    [result] = pinning.pin_cases(near_ties.SelectingCopy(path), [case], ["kept"], rerun, judge, TIGHT)
    assert result.ok, result.why
    [pick] = result.picks
    assert pick.node.startswith("NonMaxSuppression") and pick.positions == 2
    assert pick.gap == pytest.approx(1e-7, rel=0.5) and pick.gap <= pick.bound == pytest.approx(4e-7, rel=0.2)


def test_nms_with_another_iou_threshold_is_refused(tmp_path):
    path, case, rerun, judge, actual = _suppression_case(tmp_path, Suppress(graph_threshold=0.4))
    assert len(actual[0]) < len(case.expected[0])  # the graph also dropped the pair at IoU 0.43
    [result] = pinning.pin_cases(near_ties.SelectingCopy(path), [case], ["kept"], rerun, judge, TIGHT)
    assert not result.ok and "overlaps no kept box of its class past the IoU threshold" in result.why


def test_nms_keeping_a_box_its_scores_do_not_explain_is_refused(tmp_path):
    shift = torch.tensor([0, 0, 0, 0, -0.1, 0])  # the graph lowers the 0.6 box under its 0.55 neighbour
    path, case, rerun, judge, _ = _suppression_case(tmp_path, Suppress(graph_shift=shift))
    [result] = pinning.pin_cases(near_ties.SelectingCopy(path), [case], ["kept"], rerun, judge, TIGHT)
    assert not result.ok and "not float noise" in result.why
