"""detrex's DINO on the other backbones of its zoo (the stand-in's ConvNeXt and FocalNet, as detrex's dino-convnext and
dino-focalnet configs build them), through the pipeline: exported at 160x224 and verified at sizes that pad none and
some stages (333x313: odd at every stage), a transposed pair, 64x64 and a mixed batch. FocalNet's patch embeddings
pad under Python `if`s like Swin's: without `patch-embed-padding` the same export is refused."""
from __future__ import annotations

import pytest

from d2export import pipeline
from d2export.config import load
from d2export.verification import ladder
from d2export.verification.comparison import VerificationError
from d2export.patching import REGISTRY
from d2export.stage_errors import StageError

SIZES = "verify.sizes=[[224,224],[333,313],[256,192],[192,256],[64,64]]"


def _built(tmp_path, config):
    return pipeline.prepare(load(config, [f"export.output_dir={tmp_path}", SIZES, "export.lint=false"]))


@pytest.mark.parametrize("config", ["dino_convnext_tiny", "dino_focalnet_tiny"])
def test_dino_exports_verified_at_sizes_and_a_mixed_batch(tmp_path, config):
    manifest = pipeline.export((built := _built(tmp_path, config)).cfg, built=built)
    assert manifest.verification["passed"]
    cases = {c["case"] for c in manifest.verification["cases"]}
    assert len(cases) == 6 and any(c.startswith("batch") for c in cases)
    hits = {p["name"]: p["hits"] for p in manifest.patches}
    assert bool(hits["patch-embed-padding"]) == (config == "dino_focalnet_tiny"), hits  # ConvNeXt needs none


def test_focalnet_without_the_patch_embedding_patch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ladder, "_ladder_summary", lambda built: {"culprit": None})  # a second export otherwise
    monkeypatch.setattr(REGISTRY["patch-embed-padding"], "needed", lambda target: False)
    built = _built(tmp_path, "dino_focalnet_tiny")
    with pytest.raises((VerificationError, StageError)) as refused:  # wrong, or failing in onnxruntime
        pipeline.export(built.cfg, built=built)
    assert "333x313" in str(refused.value) or "Reshape" in str(refused.value), refused.value
    assert not list(tmp_path.glob("*.onnx"))
