"""What a text spotter serves, held to the model's own code (d2export/verification/served_text.py).

The served words come from the exported graph through the runtime (the manifest's charset and decoding); the
references are the unedited model's forward read by its own visualizer and, independently of d2export, by this
file's transcription of DeepSolo's reading of a custom dictionary. Every rule is shown to matter: a charset shifted
by one, CTC read as slots, TESTR's '口' dropped — each is refused.
"""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from d2export.verification import served_text
from d2export.patching import compiled_ops
from upstream_reading import deepsolo_reading

compiled_ops.install(["testr._C", "deepsolo._C"])

# 6 code points: a ReCTS-like custom dictionary (VOC_SIZE 7: 6 characters and "unknown")
CODES = [0x4E2D, 0x6587, 0x5B57, 0x7B26, 0x8BC6, 0x522B]


@pytest.fixture(scope="module")
def chinese_deepsolo(tmp_path_factory):
    """The tiny DeepSolo with a 6-character dictionary named as DeepSolo's ReCTS configs name it (relative, under
    MODEL.TRANSFORMER.CUSTOM_DICT, beside the config's folder), exported and verified; (built, manifest, path)."""
    from d2export import pipeline
    from d2export.config import load

    root = tmp_path_factory.mktemp("clone")
    (root / "chn_cls_list").write_bytes(pickle.dumps(CODES))
    out = tmp_path_factory.mktemp("deepsolo_chn")
    cfg = load("deepsolo_tiny", [f"export.output_dir={out}", f"model.sys_path=[third_party,{root}]",
                                 "model.opts=[MODEL.TRANSFORMER.VOC_SIZE,7,MODEL.TRANSFORMER.CUSTOM_DICT,chn_cls_list]"])
    built = pipeline.prepare(cfg)
    manifest = pipeline.export(cfg, built=built)
    return built, manifest, out / manifest.model_file


def test_served_words_are_deepsolos_own_on_a_custom_dictionary(chinese_deepsolo):
    from d2export.runtime.predictor import Predictor
    from d2export.tracing import dummy_images

    built, manifest, path = chinese_deepsolo
    record = manifest.verification["served_text"]
    assert record["checked"] and record["words"] == 20 and record["max_score_error"] <= 1e-4
    assert record["reader"].endswith("TextVisualizer._ctc_decode_recognition")
    assert manifest.postprocess["charset"] == "".join(map(chr, CODES))
    assert "MODEL.TRANSFORMER.CUSTOM_DICT=chn_cls_list" in manifest.postprocess["charset_source"]
    # served by the Predictor as users get it, at a size and seed verification did not use
    predictor = Predictor(path, threads=1)
    chw = dummy_images([(200, 152)], seed=99)[0]
    prepared = predictor.prepare(np.ascontiguousarray(chw.transpose(1, 2, 0)), manifest.preprocess["input_format"])
    served = predictor.predict_prepared([prepared], [0.0])[0]
    model = built.model  # given the picture as the runtime resized it, as detectron2's DefaultPredictor does
    with served_text.threshold_zero(model), torch.no_grad():
        own = model([{"image": torch.from_numpy(prepared.chw), "height": 200, "width": 152}])[0]["instances"]
    assert len(served.instances) == len(own) == 10
    words = [deepsolo_reading(ids, [chr(c) for c in CODES]) for ids in own.recs.tolist()]
    assert any(len(w) > 1 for w in words)  # words, not empty strings
    assert [i.text for i in served.instances] == words
    np.testing.assert_allclose([i.score for i in served.instances], own.scores.numpy(), atol=1e-4)


def _pictures(sizes):
    from d2export.tracing import dummy_images

    return dummy_images(sizes, seed=4242)


def _altered(manifest, **post):
    return dataclasses.replace(manifest, postprocess=manifest.postprocess | post)


def test_a_charset_shifted_by_one_or_ctc_read_as_slots_is_refused(chinese_deepsolo):
    built, manifest, path = chinese_deepsolo
    pictures = _pictures([(160, 224)])
    shifted = manifest.postprocess["charset"][1:] + manifest.postprocess["charset"][:1]
    with pytest.raises(served_text.ServedTextError, match="by the manifest's charset and decoding"):
        served_text.check(built, path, _altered(manifest, charset=shifted), pictures)
    with pytest.raises(served_text.ServedTextError, match="by the manifest's charset and decoding"):
        served_text.check(built, path, _altered(manifest, text_decoding="slots"), pictures)
    assert served_text.check(built, path, manifest, pictures)["words"] == 10  # the right one passes


def test_testr_unknown_reads_as_its_visualizer_and_dropping_it_is_refused(tiny_export):
    from d2export import pipeline

    cfg, manifest, path = tiny_export
    assert manifest.postprocess["unknown_id"] == 95 and manifest.postprocess["charset"][95] == "口"
    assert manifest.verification["served_text"]["checked"] is True
    built = pipeline.prepare(cfg)
    pictures = _pictures([(160, 224), (224, 160)])
    assert served_text.check(built, path, manifest, pictures)["words"] == 20
    with torch.no_grad(), served_text.threshold_zero(built.model):
        ids = [r for chw in pictures
               for r in built.model([{"image": torch.from_numpy(chw)}])[0]["instances"].recs.tolist()]
    assert any(95 in r for r in ids)  # the rule is exercised: some slot reads "unknown"
    dropped = manifest.postprocess["charset"][:95]
    with pytest.raises(served_text.ServedTextError, match="query"):
        served_text.check(built, path, _altered(manifest, charset=dropped), pictures)


def test_without_the_models_visualizer_the_manifest_says_so(chinese_deepsolo, monkeypatch):
    built, manifest, path = chinese_deepsolo
    monkeypatch.setattr(served_text, "own_reader", lambda *a: (None, "deepsolo.utils.visualizer cannot be imported"))
    record = served_text.check(built, path, manifest, _pictures([(160, 224)]))
    assert record["words"] == "not checked: deepsolo.utils.visualizer cannot be imported"
    assert record["instances"] == 10 and record["max_score_error"] <= 1e-4  # the scores still are


def test_a_dictionary_of_the_wrong_length_stops_the_export_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "chn_cls_list").write_bytes(pickle.dumps(CODES))
    run = subprocess.run([sys.executable, "tools/export.py", "--config", "deepsolo_tiny",
                          f"export.output_dir={tmp_path / 'out'}", f"model.sys_path=[third_party,{tmp_path}]",
                          "model.opts=[MODEL.TRANSFORMER.VOC_SIZE,5462,MODEL.TRANSFORMER.CUSTOM_DICT,chn_cls_list]"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "holds 6 characters; the head's VOC_SIZE 5462 reads 5461" in last and "Traceback" not in run.stderr
    assert not (tmp_path / "out" / "model.onnx").exists()
