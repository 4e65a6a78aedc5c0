"""Verification through near-tied selections (d2export/exporting/pinning.py): a graph that picked differently only
among candidates within float noise passes, with the graph's pick imposed on eager; every wrong graph still fails.

Ties and faults are planted so that they fire only while the graph is traced (`torch.onnx.is_in_onnx_export()`):
eager PyTorch, the independent side, never sees them.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from d2export import pipeline
from d2export.config import load
from d2export.exporting import pinning
from d2export.exporting.verify import Case, VerificationError, compare_case

QUANTUM = 0.25  # planted ties: proposal logits rounded to this step in eager and graph alike


def _pattern(n: int, dtype) -> torch.Tensor:
    """A fixed, traceable, non-monotonic pattern over n candidates: it breaks exact ties another way than eager."""
    return torch.sin(torch.arange(n, dtype=dtype) * 12.9898)


def plant_ties(module: nn.Module, graph_noise: float):
    """Proposal logits rounded to QUANTUM (exact ties, in eager and in the graph) plus, in the graph only,
    `graph_noise` × a fixed pattern: below the near-tie bound it is another CPU's rounding; above it a real fault."""

    def hook(_, __, out):
        out = torch.round(out / QUANTUM) * QUANTUM
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
    return pipeline.prepare(load(config, [f"export.output_dir={tmp_path}", SIZES, *overrides]))


def _module(built, name: str) -> nn.Module:
    return dict(built.model.named_modules())[name]


@pytest.fixture
def no_ladder(monkeypatch):
    """The parity ladder (run on every failure) is not what these tests look at; it costs a second export."""
    monkeypatch.setattr(pipeline, "_ladder", lambda built: {"culprit": None})


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


def test_float16_graph_with_ties_passes_by_pinning(tmp_path):
    built = _built("textdet_tiny", tmp_path, "export.fp16=true")
    plant_ties(_module(built, FAMILIES["textdet_tiny"]), graph_noise=1e-7)
    manifest = pipeline.export(built.cfg, built=built)
    assert manifest.precision == "float16" and manifest.verification["fp16"]["passed"]


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
    assert "past the near-tie bound" in message
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
    assert "past the near-tie bound" in message
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
    message = _refused(_built("textdet_tiny", tmp_path))
    assert "does not select what eager selects" in message


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
    [result] = pinning.pin_cases(path, [case], ["picked"], rerun, judge)
    assert result.ok, result.why
    assert result.picks and result.picks[0].positions > 0 and result.picks[0].gap == 0.0
    assert "picked differently; with the graph's selection every output agrees" in result.line()


def test_pinning_refuses_a_pick_outside_the_noise(tmp_path):
    scores = np.array([[3.0, 2.9, 2.8, 2.7, 2.6, 1.0, 0.5, 0.25]], np.float32)
    path, case, rerun, judge, _ = _two_stage_case(tmp_path, 0.3, scores)  # lifts candidate 5-ish: a real change
    [result] = pinning.pin_cases(path, [case], ["picked"], rerun, judge)
    assert not result.ok and "past the near-tie bound" in result.why


def test_pinning_says_when_the_selections_agree(tmp_path):
    scores = np.array([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]], np.float32)
    path, case, rerun, _, actual = _two_stage_case(tmp_path, 0.0, scores)
    wrong = lambda name, e, a: (cs := compare_case(name, e, {"picked": a["picked"] + 1}, 1e-5, 1e-5),  # noqa: E731
                                all(c.ok for c in cs))
    [result] = pinning.pin_cases(path, [case], ["picked"], rerun, wrong)
    assert not result.ok and "not a tie" in result.why


def test_the_bound_is_relative_to_the_values_size():
    x = torch.tensor([[1000.0, 1000.004, 999.0, 10.0]])
    graph = pinning._GraphPick("n", (1, 4), 1, 1, True, np.array([[0]]))  # 1000.0 instead of 1000.004
    with pinning.pinned_topk([graph], 1e-5) as pinner:
        values, indices = torch.topk(x, 1, dim=1)
    assert indices.tolist() == [[0]] and values.tolist() == [[1000.0]]  # 4e-3 apart at 1000: within 1e-5 relative
    assert pinner.found[0].gap == pytest.approx(0.004, rel=1e-2) and pinner.found[0].tied
    small = torch.tensor([[1.0, 1.004, 0.5, 0.1]])
    graph = pinning._GraphPick("n", (1, 4), 1, 1, True, np.array([[0]]))
    with pinning.pinned_topk([graph], 1e-5) as pinner:
        _, indices = small.topk(1, dim=1)  # the Tensor method is pinned too
    assert indices.tolist() == [[1]] and not pinner.found[0].tied  # 4e-3 at 1.0: a real difference, eager keeps its own


def test_calls_of_another_signature_are_left_alone_and_topk_is_restored():
    original, method = torch.topk, torch.Tensor.topk
    other = torch.tensor([[5.0, 1.0, 3.0]])
    x = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    own = torch.topk(x, 2, dim=1)[1].tolist()[0]
    graph = pinning._GraphPick("n", (1, 4), 2, 1, True, np.array([own[::-1]]))  # an exact tie ordered the other way
    with pinning.pinned_topk([graph], 1e-5) as pinner:
        assert torch.topk(other, 2, dim=1)[1].tolist() == [[0, 2]]  # another shape: eager's own
        assert torch.topk(x, 2, dim=1)[1].tolist() == [own[::-1]]  # the graph's
    assert pinner.found and pinner.found[0].positions == 2 and pinner.found[0].gap == 0.0
    assert torch.topk is original and torch.Tensor.topk is method
    assert re.search(r"topk", str(torch.topk))
