"""DeepSolo++ (issue 93): a language head and a text head per script, routed per query in the graph, read per
script with its own 1-based JSON charset (stand-in: third_party/deepsolo_plus). References: the unedited model's own
forward, read here by this file's transcription of DeepSolo++'s per-script CTC reading from the JSON files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from d2export.verification import served_text
from d2export.patching import compiled_ops

compiled_ops.install(["deepsolo._C", "testr._C"])
ROOT = Path(__file__).resolve().parent.parent
CHAR_MAP = ROOT / "third_party" / "deepsolo_plus" / "char_map" / "idx2char"


def plus_reading(ids, language) -> str:
    """DeepSolo++'s _ctc_decode_recognition, transcribed: idx2char keys "1".."V", 0 the blank ends a run."""
    idx2char = json.loads((CHAR_MAP / f"{language}.json").read_text())
    text, last = "", None
    for c in ids:
        if c != 0:
            if c != last:
                text += idx2char[str(c)]
            last = c
        else:
            last = None
    return text


def scripts_apart(built):
    """Seeded weights send every query to one script: the language head's weights spread and its bias set so that
    queries of a picture fall on both sides, so both heads are read."""
    from d2export.tracing import dummy_images

    model = built.model
    with torch.no_grad():
        language = model.detection_transformer.inst_language[-1]
        language.weight.mul_(50.0)
        images = model.preprocess_image([{"image": torch.from_numpy(chw)} for chw in dummy_images([(160, 224)])])
        logits = model.detection_transformer(images)["pred_lan_logits"]
        language.bias[1] += (logits[..., 0] - logits[..., 1]).median()


@pytest.fixture(scope="module")
def plus(tmp_path_factory):
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("deepsolo_plus")
    cfg = load("deepsolo_plus_tiny", [f"export.output_dir={out}"])
    built = pipeline.prepare(cfg)
    scripts_apart(built)
    return built, pipeline.export(cfg, built=built), out, cfg


def test_each_query_is_read_in_its_own_script(plus):
    from d2export.runtime.predictor import Predictor
    from d2export.tracing import dummy_images

    built, manifest, out, _ = plus
    assert manifest.family == "deepsolo_plus" and manifest.outputs[-1].name == "languages"
    assert manifest.postprocess["languages"] == ["Latin", "Symbols"]
    assert manifest.postprocess["charsets"]["Latin"][0] == "" and len(manifest.postprocess["charsets"]["Symbols"]) == 6
    v = manifest.verification
    assert v["passed"] is True and len({c["case"] for c in v["cases"]}) == 6
    assert v["served_text"]["words"] == 20 and v["served_text"]["max_score_error"] <= 1e-4
    predictor = Predictor(out / manifest.model_file, threads=1)
    chw = dummy_images([(176, 208)], seed=5)[0]
    prepared = predictor.prepare(np.ascontiguousarray(chw.transpose(1, 2, 0)), manifest.preprocess["input_format"])
    served = predictor.predict_prepared([prepared], [0.0])[0].instances
    with served_text.threshold_zero(built.model), torch.no_grad():
        own = built.model([{"image": torch.from_numpy(prepared.chw), "height": 176, "width": 208}])[0]["instances"]
    scripts = [["Latin", "Symbols"][i] for i in own.languages.tolist()]
    assert set(scripts) == {"Latin", "Symbols"}  # both heads are read
    assert [i.language for i in served] == scripts
    assert [i.text for i in served] == [plus_reading(ids, s) for ids, s in zip(own.recs.tolist(), scripts)]
    assert any("x\u0313" in i.text for i in served)  # an entry of two code points
    np.testing.assert_allclose([i.score for i in served], own.scores.numpy(), atol=1e-4)


def test_characters_from_one_head_for_every_query_are_refused(plus, monkeypatch):
    """The graph reading every query's characters from the first script's head: verified against an eager
    reference with the same rule, refused against the model's own routing."""
    from d2export.families import deepsolo
    from d2export.tracing import dummy_images

    built, manifest, out, _ = plus
    real = deepsolo.decode_plus

    def first_head(raw, sizes):
        flat = real(raw, sizes)
        return flat[:-1] + (torch.zeros_like(flat[-1]),)

    monkeypatch.setattr(deepsolo, "decode_plus", first_head)
    from d2export import pipeline
    from d2export.config import load

    cfg = load("deepsolo_plus_tiny", [f"export.output_dir={out}_one_head"])
    wrong = pipeline.prepare(cfg)
    scripts_apart(wrong)
    with pytest.raises(served_text.ServedTextError, match="served in Latin, the model reads Symbols"):
        pipeline.export(cfg, built=wrong)


def test_a_charset_of_the_wrong_size_is_refused_in_one_line(tmp_path):
    from d2export.charset import CharsetError
    from d2export.families import get
    from deepsolo_plus.config import get_cfg

    cfg = get_cfg()
    cfg.MODEL.TRANSFORMER.LANGUAGE.VOC_SIZES = [["Latin", 11], ["Symbols", 5]]
    with pytest.raises(CharsetError, match="Latin.json: 12 characters from index 1; Latin's VOC_SIZES entry reads 11"):
        get("deepsolo_plus").text_charset(cfg, None, [CHAR_MAP.parent.parent])


def test_a_chunk_size_that_does_not_divide_its_dim_exports_as_torch_splits():
    """DeepSolo++ splits its point queries from its language token by `hs.split(hs.shape[3] - 1, dim=3)` (25 and 1 of
    26): exported as is, the Split's pieces are equal and onnxruntime refuses; the split-whole patch narrows."""
    import io

    import onnxruntime as ort

    import d2export.patching.zoo  # noqa: F401 - registers split-whole
    from d2export.patching import apply_patches

    class Head(torch.nn.Module):
        def forward(self, x):
            points, token = torch.split(x, x.shape[3] - 1, dim=3)
            return points * 2, token + 1

    def exported(patched: bool):
        f = io.BytesIO()
        with apply_patches(model=Head(), only=["split-whole"] if patched else []):
            torch.onnx.export(Head(), (torch.randn(1, 2, 3, 26),), f, dynamo=False, input_names=["x"],
                              dynamic_axes={"x": {2: "h", 3: "p"}})
        return ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])

    x = torch.randn(1, 2, 5, 26)
    for got, want in zip(exported(True).run(None, {"x": x.numpy()}), Head()(x)):
        np.testing.assert_array_equal(got, want.numpy())
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    with pytest.raises(InvalidArgument, match="Split size 25 exceeds the remaining size"):
        exported(False).run(None, {"x": x.numpy()})
