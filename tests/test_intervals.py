"""How sure a difference in accuracy is (d2export/evaluating/intervals.py): the paired bootstrap over pictures,
checked against outcomes worked out by hand, and its per-picture counts against the text evaluator's own."""
import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.structures import Instances

from d2export.charset import charset, decode
from d2export.datasets import generate, register
from d2export.evaluating import intervals
from d2export.evaluating.evaluators import TextSpottingEvaluator
from d2export.evaluating.runs import Run
from d2export.instances import Instance, Prediction

# one row per picture: words, detections, matched, read, chars, char_errors (text_metrics.Counts)
READ = [1, 1, 1, 1, 3, 0]  # one word of 3 characters, found and read
MISREAD = [1, 1, 1, 0, 3, 3]  # found, every character wrong
TEXT = intervals.text_figures


def test_two_pictures_give_the_three_outcomes_worked_out_by_hand():
    """Pictures A (the other run misreads its word) and B (both read it). Drawn twice with replacement: AA (1/4) the
    other run reads 0 of 2 words, end-to-end -100; AB or BA (1/2) 1 of 2, -50; BB (1/4) 0. Each outcome holds over
    2.5% of the draws, so the 95% interval is [-100, 0]; on both pictures once, -50. Detection is the same: 0."""
    found = intervals.paired(np.array([READ, READ]), np.array([MISREAD, READ]), TEXT)
    assert found["text/e2e_hmean"] == {"delta": -50.0, "low": -100.0, "high": 0.0}
    assert found["text/det_hmean"] == {"delta": 0.0, "low": 0.0, "high": 0.0}


def test_same_runs_differ_by_nothing_and_the_interval_narrows_with_pictures():
    same = np.array([READ, MISREAD, READ])
    assert intervals.paired(same, same, TEXT)["text/e2e_hmean"] == {"delta": 0.0, "low": 0.0, "high": 0.0}
    widths = []
    for repeat in (10, 40):  # the same share of misread words (1 in 5), on 4x the pictures
        reference = np.array([READ] * 5 * repeat)
        other = np.array(([MISREAD] + [READ] * 4) * repeat)
        f = intervals.paired(reference, other, TEXT)["text/e2e_hmean"]
        assert f["delta"] == pytest.approx(-20.0) and f["low"] < -20.0 < f["high"]
        widths.append(f["high"] - f["low"])
    assert 0.35 < widths[1] / widths[0] < 0.65  # about 1/sqrt(4)


def test_each_draw_takes_as_many_pictures_as_there_are():
    w = intervals.draws(7, n=500)
    assert w.shape == (500, 7) and (w >= 0).all() and (w.sum(1) == 7).all()
    assert np.allclose(w.mean(0), 1.0, atol=0.15)  # every picture drawn once a draw on average, none favoured
    assert len({tuple(r) for r in w}) > 300  # the draws differ (1716 ways to draw 7 of 7)


def test_runs_over_other_pictures_are_refused():
    with pytest.raises(ValueError, match="same pictures"):
        intervals.paired(np.array([READ]), np.array([READ, READ]), TEXT)


def test_per_picture_counts_sum_to_what_the_text_evaluator_reports(tmp_path):
    """Predictions made from the labels, one word misread and one picture's words all missed: the counts summed over
    pictures give the figures TextSpottingEvaluator computes from the same detections as detectron2 Instances."""
    folder = generate("text", tmp_path / "text", count=3, seed=5, size=(224, 176), workers=1)
    name = register("intervals_text", folder)
    try:
        chars = charset(96)
        post = {"charset": "".join(chars), "text_decoding": "slots"}
        records = DatasetCatalog.get(name)
        evaluator = TextSpottingEvaluator(name, post)
        predictions = []
        for k, r in enumerate(records):
            anns = [] if k == 2 else r["annotations"]
            texts = [decode(list(a["rec"]), chars) for a in anns]
            if k == 0:
                texts[0] = "~" + texts[0][1:]
            predictions.append(Prediction(r["height"], r["width"], [
                Instance(score=1.0, label=0, polygon=np.asarray(a["polys"], float).reshape(-1, 2).tolist(), text=t)
                for a, t in zip(anns, texts)]))
            inst = Instances((r["height"], r["width"]))
            inst.scores = torch.ones(len(anns))
            inst.polygons = torch.tensor([a["polys"] for a in anns] or torch.zeros(0, 32), dtype=torch.float32)
            inst.texts = texts
            evaluator.process([r], [{"instances": inst}])
        counts = intervals.statistics([intervals.text_measure(name)], Run("x", "float32", {}, predictions), records)[0]
        assert counts.shape == (3, 6) and counts[2, 1] == 0  # the last picture: no detections
        own = evaluator.evaluate()["text"]
        summed = intervals.Counts(*counts.sum(0)).summary()
        assert summed == pytest.approx(own) and own["e2e_hmean"] < own["det_hmean"] < 100.0
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


def test_the_accuracy_gate_records_each_interval_and_says_when_its_pictures_cannot_rule_out_a_loss(monkeypatch,
                                                                                                    caplog):
    """verify.int8_accuracy: the verdict stays the point difference's (within the bound: written); the record holds
    the interval, and an interval reaching past the bound is said in the log."""
    from d2export.verification import held_out_accuracy as h

    held = h.HeldOut("held", [{}] * 20, "text", ())
    reference = Run("x", "float32", {"text/det_hmean": 80.0, "text/e2e_hmean": 60.0}, [])
    run = Run("x", "int8", {"text/det_hmean": 79.8, "text/e2e_hmean": 59.5}, [])
    monkeypatch.setattr(h, "_intervals", lambda *a: {"text/det_hmean": {"delta": -0.2, "low": -0.9, "high": 0.4},
                                                     "text/e2e_hmean": {"delta": -0.5, "low": -2.1, "high": 1.0}})
    with caplog.at_level("INFO", logger="d2export"):
        record = h.judge(reference, run, 1.0, held)
    assert record["passed"] is True
    assert record["metrics"]["text/e2e_hmean"]["interval"] == [-2.1, 1.0]
    assert "95% interval [-2.10, +1.00]" in caplog.text
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "cannot rule out" in warned[0] and "text/e2e_hmean down to -2.10" in warned[0]
    assert "det_hmean" not in warned[0]
    # the interval reaches 1.6 under the difference, which sits 0.5 inside the bound: (1.6 / 0.5)² x 20 pictures
    assert "about 205 labelled pictures would" in warned[0]


def test_a_difference_at_the_bound_gets_no_picture_count(monkeypatch, caplog):
    from d2export.verification import held_out_accuracy as h

    held = h.HeldOut("held", [{}] * 20, "text", ())
    reference = Run("x", "float32", {"text/det_hmean": 80.0}, [])
    run = Run("x", "int8", {"text/det_hmean": 79.0}, [])  # exactly max_drop lost: passes, but no margin is left
    monkeypatch.setattr(h, "_intervals", lambda *a: {"text/det_hmean": {"delta": -1.0, "low": -1.5, "high": -0.5}})
    with caplog.at_level("INFO", logger="d2export"):
        assert h.judge(reference, run, 1.0, held)["passed"] is True
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "no number of pictures would" in warned[0]
