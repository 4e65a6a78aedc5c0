"""The spotters built on the three papers, as variants of their families (issue 93): DNTextSpotter (DeepSolo's head
returning (outputs, denoising record)) and SRFormer (DPText-DETR's lineage: per-query class logits, offsets, a mask
branch for training). Stand-ins: third_party/deepsolo/modeling/dn_spotter.py, third_party/dptext/modeling/srformer.py.
Each exports, verifies at five sizes and a batch, and serves what the unedited model returns (scores within 1e-4;
DNTextSpotter's words as its own visualizer reads them) — held in the export by d2export/verification/served_text.py,
whose refusal of a wrong scoring rule is shown here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from d2export import families
from d2export.verification import served_text
from d2export.patching import compiled_ops
from upstream_reading import deepsolo_reading

compiled_ops.install(["dptext._C", "deepsolo._C", "testr._C"])


def export(config, tmp_path_factory, *overrides):
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp(config)
    cfg = load(config, [f"export.output_dir={out}", *overrides])
    built = pipeline.prepare(cfg)
    return built, pipeline.export(cfg, built=built), out


@pytest.fixture(scope="module")
def dn(tmp_path_factory):
    return export("dntextspotter_tiny", tmp_path_factory)


@pytest.fixture(scope="module")
def srformer(tmp_path_factory):
    return export("srformer_tiny", tmp_path_factory)


def test_dntextspotter_head_returning_a_pair_exports_and_serves_its_own_words(dn):
    from d2export.runtime.predictor import Predictor
    from d2export.tracing import dummy_images

    built, manifest, out = dn
    assert type(built.model).__name__ == "DNTextSpotter" and manifest.family == "deepsolo"
    v = manifest.verification
    assert v["passed"] is True and len(v["cases"]) > 0 and len({c["case"] for c in v["cases"]}) == 6
    assert v["served_text"]["words"] == 20 and v["served_text"]["max_score_error"] <= 1e-4
    # served as users get it, on a picture and size verification did not use, against an independent reading
    predictor = Predictor(out / manifest.model_file, threads=1)
    chw = dummy_images([(176, 208)], seed=77)[0]
    prepared = predictor.prepare(np.ascontiguousarray(chw.transpose(1, 2, 0)), manifest.preprocess["input_format"])
    served = predictor.predict_prepared([prepared], [0.0])[0].instances
    with served_text.threshold_zero(built.model), torch.no_grad():
        own = built.model([{"image": torch.from_numpy(prepared.chw), "height": 176, "width": 208}])[0]["instances"]
    assert [i.text for i in served] == [deepsolo_reading(ids) for ids in own.recs.tolist()]
    np.testing.assert_allclose([i.score for i in served], own.scores.numpy(), atol=1e-4)


def test_srformer_is_its_own_variant_scored_per_query(srformer):
    built, manifest, _ = srformer
    assert manifest.family == "srformer"
    assert "lacks ctrl_point_coord" in families.get("dptext").missing(built.model)
    assert families.recognise(built.model, "auto").name == "srformer"
    v = manifest.verification
    assert v["passed"] is True and len({c["case"] for c in v["cases"]}) == 6
    assert v["served_text"]["instances"] == 20 and v["served_text"]["max_score_error"] <= 1e-4
    assert "words" not in v["served_text"]  # it reads no text
    # its mask branch's torch transformer layer ran with the fast path off (else: no ONNX translation)
    assert {p["name"]: p for p in manifest.patches}["transformer-layer-math-path"]["hits"] > 0


def test_a_wrong_scoring_rule_is_refused_against_srformers_own_inference(srformer, monkeypatch, tmp_path):
    """Scores without SRFormer's sigmoid: the graph and its eager reference agree (both use the rule), what is
    served does not agree with the model's own inference."""
    from d2export import pipeline
    from d2export.config import load
    from d2export.families import dptext

    def raw_logits(out, sizes):
        scores, labels = out["pred_logits"].max(-1)
        return scores, labels, dptext.to_pixels(out["pred_ctrl_points"], sizes)

    monkeypatch.setattr(dptext, "decode_srformer", raw_logits)
    cfg = load("srformer_tiny", [f"export.output_dir={tmp_path}"])
    with pytest.raises(served_text.ServedTextError, match="not what the model returns"):
        pipeline.export(cfg)
    assert not (tmp_path / "model.onnx").exists()
