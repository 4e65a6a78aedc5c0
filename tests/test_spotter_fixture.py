"""The trained micro spotter (tests/data/spotter_fixture.pth): a TESTR-architecture model that finds words in pictures
it never saw, exported, verified in float32 and float16 and evaluated with figures that mean something."""
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from d2export.datasets import generate
from exports import export

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "spotter_fixture.pth"
RECORD = json.loads(FIXTURE.with_suffix(".json").read_text())
# A floor well under what the record measured on 200 held-out pictures, so 8 pictures' noise cannot fail it; seeded
# weights (detection H-mean 0) fail it.
DET_FLOOR = 0.7 * RECORD["held_out"]["det_hmean"]
CHAR_FLOOR = 0.7 * RECORD["held_out"]["char_accuracy"]  # and reads: the fixture before read 16%


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Pictures the fixture never saw: not its training (0), held-out (1) or validation (2) seed, nor the demo's (3)."""
    return generate("text", tmp_path_factory.mktemp("held_out") / "text", count=8, seed=7, size=(320, 320),
                    workers=1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("textdet_micro")
    return out, export("textdet_micro", out)


def test_the_fixture_is_what_its_record_says():
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == RECORD["sha256"]
    assert FIXTURE.stat().st_size == RECORD["bytes"] <= 10 * 2**20
    # the recipe's last stage: the whole spotter, or its text branch alone (detection as the stage before had it)
    assert RECORD["command"].startswith(("python training/train_spotter.py", "python training/probe_decoder.py"))
    seeds = {RECORD["train"]["seed"], RECORD["validation"]["seed"]}
    assert RECORD["held_out"]["seed"] not in seeds and RECORD["held_out"]["count"] >= 200
    assert RECORD["held_out"]["det_hmean"] >= 40  # it finds words


def test_the_model_config_reads_at_the_size_the_record_scored():
    """The record's held-out figures are what the export serves: the record states the test size its weights were
    scored at, and the model config the export reads sets the same (read at 320 instead of 480, these weights read
    72% of the validation pictures' characters, not 90%)."""
    config = yaml.safe_load((REPO / RECORD["config"]).read_text())
    read_at = RECORD["held_out"]["read_at"]
    assert (read_at["min_size"], read_at["max_size"]) == (config["INPUT"]["MIN_SIZE_TEST"],
                                                          config["INPUT"]["MAX_SIZE_TEST"])


def test_export_verifies_with_the_trained_weights(exported):
    _, manifest = exported
    assert manifest.verification["passed"] is True and manifest.family == "testr"
    assert manifest.weights["path"].endswith("spotter_fixture.pth") and not manifest.weights["missing"]
    assert manifest.weights.get("kind") != "seeded"


def test_evaluate_pytorch_and_onnx_agree_on_text(exported, held_out):
    from d2export.evaluating.evaluate import evaluate

    out, _ = exported
    report = evaluate([str(out)], dataset=str(held_out), config="textdet_micro")
    torch_run, onnx_run = report["runs"]
    t, o = torch_run["metrics"], onnx_run["metrics"]
    print(f"held-out: PyTorch det {t['text/det_hmean']:.1f} chars {t['text/char_accuracy']:.1f} "
          f"e2e {t['text/e2e_recall']:.1f}; "
          f"ONNX det {o['text/det_hmean']:.1f} e2e {o['text/e2e_recall']:.1f}")
    assert t["text/det_hmean"] >= DET_FLOOR and t["text/words"] >= 20
    assert t["text/char_accuracy"] >= CHAR_FLOOR
    for key in ("text/det_hmean", "text/e2e_recall", "text/e2e_hmean", "text/char_accuracy"):
        assert abs(o[key] - t[key]) <= 0.1, key
    assert report["comparisons"][0]["differing_pictures"] == 0


def test_float16_export_verifies_on_text(tmp_path, text_pictures):
    """On the pictures of its domain (verify.pictures), where its characters are confident: on noise pictures a
    reader's confident detections read strokes at character probabilities near 0.3, where float16 moves them most
   ."""
    manifest = export("textdet_micro", tmp_path, "export.fp16=true", f"verify.pictures={text_pictures}",
                      "export.lint=false")
    v = manifest.verification["fp16"]
    assert manifest.precision == "float16" and v["passed"] is True and manifest.verification["passed"] is True
    assert all(c["case"].endswith(".jpg)") for c in v["cases"])


def test_a_float16_reader_whose_characters_lean_is_refused_on_text_too(tmp_path, text_pictures, monkeypatch):
    """The float16 graph with every other character's logit raised by 1 (its classifier's bias): on the domain's
    pictures, as on noise, refused, and nothing written."""
    import numpy as np
    from onnx import numpy_helper

    from d2export.exporting import fp16
    from d2export.verification.comparison import VerificationError

    convert = fp16.to_float16

    def leaning(model, **kwargs):
        model = convert(model, **kwargs)
        for i, init in enumerate(model.graph.initializer):
            if init.name.endswith("text_class.bias"):
                bias = numpy_helper.to_array(init).copy()
                bias[::2] += np.float16(1.0)
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(bias, init.name))
                return model
        raise AssertionError("no text_class.bias in the graph")

    monkeypatch.setattr(fp16, "to_float16", leaning)
    with pytest.raises(VerificationError, match="float16 graph disagrees"):
        export("textdet_micro", tmp_path, "export.fp16=true", f"verify.pictures={text_pictures}",
               "export.lint=false")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))
