"""training/probe_reading.py: where a spotter misreads, by the words' shape, height and length (hand-made outlines and
reads), and its figures over a set agree with the text evaluator's on the same pictures."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # training/ is the fixtures' workshop, not the package
from training import probe_reading  # noqa: E402
from training.common import cpu_spotter, evaluate, reading  # noqa: E402

from d2export.evaluating.text_metrics import Word  # noqa: E402


def band(top, bottom):
    """An outline as AdelaiDet writes it: the top edge left to right, then the bottom right to left."""
    return np.concatenate([top, bottom[::-1]])


def line(x0, x1, y, n=8):
    return np.stack([np.linspace(x0, x1, n), np.full(n, float(y))], 1)


def turned(points, degrees):
    a = math.radians(degrees)
    return points @ np.array([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]])


@pytest.mark.parametrize("degrees, kind", [(0, "straight"), (2, "straight"), (30, "rotated"), (-45, "rotated")])
def test_straight_bands_are_straight_or_rotated_and_as_high_as_drawn(degrees, kind):
    outline = turned(band(line(10, 90, 20), line(10, 90, 32)), degrees)
    assert probe_reading.outline_geometry(outline) == (kind, pytest.approx(12.0))


def test_a_band_along_an_arc_is_curved():
    angles = np.linspace(math.radians(120), math.radians(60), 8)  # left to right over the top of a circle

    def arc(radius):
        return np.stack([100 + radius * np.cos(angles), 200 - radius * np.sin(angles)], 1)

    assert probe_reading.outline_geometry(band(arc(110), arc(95))) == ("curved", pytest.approx(15.0))


def word(text, height=12.0):
    return Word(band(line(0, 60, 0), line(0, 60, height)), text)


def test_breakdown_counts_as_by_hand():
    rows = [probe_reading.row(word("Hello"), "HELLO"),  # read whole (case does not count)
            probe_reading.row(word("world", 20), "word"),  # one character short
            probe_reading.row(word("abc"), "abd"),  # one substituted, at position 2
            probe_reading.row(word("missed", 30), None)]  # not found
    figures = probe_reading.breakdown(rows)
    assert figures["all"] == {"words": 4, "found": 75.0, "chars": round(100 * 11 / 13, 1), "whole": 33.3,
                              "other_length": 33.3}
    assert figures["shape"]["straight"]["words"] == 4 and figures["shape"]["curved"]["words"] == 0
    assert figures["height_px"]["10-14"] == {"words": 2, "found": 100.0, "chars": 87.5, "whole": 50.0,
                                             "other_length": 0.0}
    assert figures["height_px"]["24+"] == {"words": 1, "found": 0.0, "chars": None, "whole": None,
                                           "other_length": None}
    assert figures["length"]["3-4"]["words"] == 1 and figures["length"]["5-6"]["words"] == 3
    assert figures["substituted_at"] == {0: 0.0, 1: 0.0, 2: 50.0, 3: 0.0, 4: 0.0}  # HELLO and ABD
    assert figures["confusions"] == {"C>D": 1}


def test_over_a_set_it_agrees_with_the_text_evaluator(tmp_path, capsys):
    import json

    from d2export.datasets import generate

    generate("text", tmp_path / "pics", count=4, seed=7, size=(320, 320))
    assert probe_reading.main(["--data", str(tmp_path / "pics"), "--json", str(tmp_path / "f.json")]) == 0
    mine = json.loads((tmp_path / "f.json").read_text())["all"]
    assert "shape straight" in capsys.readouterr().out

    from detectron2.data import DatasetCatalog
    from testr.data import DatasetMapperWithBasis

    cfg, model = cpu_spotter(str(probe_reading.REPO / "third_party/testr/configs/micro_spotter.yaml"), [], 1,
                             probe_reading.REPO / "tests/data/spotter_fixture.pth")
    theirs, _ = evaluate(model, DatasetCatalog.get("probe_reading"), DatasetMapperWithBasis(cfg, is_train=False),
                         "probe_reading", reading(cfg))
    assert mine["words"] == theirs["words"] > 0
    assert mine["found"] == round(theirs["det_recall"], 1)
    assert mine["chars"] == round(theirs["char_accuracy"], 1)
    assert round(mine["whole"] * mine["found"] / 100, 1) == pytest.approx(round(theirs["e2e_recall"], 1), abs=0.11)
