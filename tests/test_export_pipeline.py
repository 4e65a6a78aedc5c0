"""The export pipeline end to end on the tiny TESTR-architecture spotter, and its failure modes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from d2export import pipeline
from d2export.manifest import Manifest, manifest_path, sha256_file
from d2export.tracing import dummy_images, graph_inputs
from exports import export

REPO = Path(__file__).resolve().parent.parent


def export_cli(*args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "export.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_tiny_export_is_verified_and_described(tiny_export):
    cfg, manifest, model_path = tiny_export
    onnx.checker.check_model(onnx.load(str(model_path)), full_check=True)
    assert manifest.sha256 == sha256_file(model_path)
    assert [t.name for t in manifest.inputs] == ["images", "image_sizes"]
    assert [t.name for t in manifest.outputs] == ["scores", "labels", "ctrl_points", "char_ids", "char_scores"]
    assert manifest.inputs[0].shape == ["batch", 3, "height", "width"]
    assert manifest.outputs[2].shape[0] == "batch" and manifest.outputs[2].shape[2:] == [16, 2]
    v = manifest.verification
    assert v["passed"] is True
    cases = {c["case"] for c in v["cases"]}
    h, w = cfg.export.dummy_sizes[0]
    assert {f"{h}x{w}", f"{w}x{h}"} <= cases  # the transposed size: same tokens, other aspect ratio
    assert any(c.startswith("batch ") for c in cases)
    assert v["lint"]["clean"] is True
    assert v["providers"] == ["CPUExecutionProvider"] and "CPUExecutionProvider" in v["provider_options"]
    assert v["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # export.device=auto
    assert set(manifest.versions) >= {"torch", "onnx", "onnxruntime", "detectron2", "d2export"}
    assert manifest.preprocess["input_format"] == "RGB"  # TESTR configs feed RGB
    assert len(manifest.postprocess["charset"]) == 96


def test_patch_report_shows_the_msda_swap_and_rewrites(tiny_export):
    _, manifest, _ = tiny_export
    by_name = {p["name"]: p for p in manifest.patches}
    assert by_name["msda-core"]["status"] == "applied"
    assert by_name["msda-core"]["sites"] == 3  # 1 encoder + 2 decoder attentions in the tiny model
    for name in ("sizes-as-tensor", "padding-mask-from-sizes", "reference-points-per-level",
                 "encoder-proposals-per-level"):
        assert by_name[name]["hits"] > 0, name


def test_graph_has_no_grid_sample_with_gather_sampler(tiny_export):
    _, _, model_path = tiny_export
    ops = {n.op_type for n in onnx.load(str(model_path)).graph.node}
    assert "GridSample" not in ops and "Gather" in ops


@pytest.mark.parametrize("sizes", [[(96, 200)], [(200, 96), (150, 150), (120, 230)]], ids=["96x200", "batch3"])
def test_dynamic_shapes_match_eager_at_unseen_sizes(tiny_export, sizes):
    cfg, _, model_path = tiny_export
    built = pipeline.prepare(cfg)  # the same seeded model, unpatched: the eager side
    images = dummy_images(sizes, seed=4242)
    expected = built.adapter.reference(images)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    actual = session.run(None, graph_inputs(built.adapter, images))
    for name, e, a in zip(built.adapter.output_names, expected, actual):
        assert e.shape == a.shape, name
        if np.issubdtype(e.dtype, np.integer):
            assert (e != a).mean() <= 1e-3, name
        else:
            np.testing.assert_allclose(a, e, atol=2e-4, rtol=1e-3, err_msg=name)


def test_exporting_twice_gives_the_same_graph(tmp_path):
    overrides = ["export.lint=false", "verify.enabled=false"]
    first = export("textdet_tiny", tmp_path / "a", *overrides)
    second = export("textdet_tiny", tmp_path / "b", *overrides, "export.dummy_sizes=[[192,160]]")
    assert first.sha256 == second.sha256  # also at another dummy size: nothing of the dummy is baked in


def test_plain_rcnn_exports_unchanged_with_plugin_active(tmp_path):
    """A detectron2 R-CNN goes through the same pipeline with every patch active and none hit, verified."""
    manifest = export("rcnn", tmp_path, "export.lint=false")
    assert manifest.verification["passed"] is True and manifest.family == "rcnn"
    assert Manifest.read(manifest_path(tmp_path / manifest.model_file)) == manifest  # what was written is returned
    statuses = {p["name"]: p["status"] for p in manifest.patches}
    assert statuses["msda-core"] == "unused" and "applied" not in {statuses[k] for k in (
        "padding-mask-from-sizes", "reference-points-per-level", "encoder-proposals-per-level")}


def test_cli_exports_with_overrides_and_writes_manifest(tmp_path):
    out = tmp_path / "run"
    r = export_cli("--config", "textdet_tiny", f"hydra.run.dir={out}", "export.lint=false",
                   "verify.sizes=[[160,224],[224,160]]", "verify.batch=false", "export.opset=16")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "model.manifest.json").read_text())
    assert manifest["opset"] == 16 and manifest["verification"]["passed"] is True
    assert onnx.load(str(out / "model.onnx")).opset_import[0].version == 16


def test_cli_multirun_ends_with_one_summary_table(tmp_path):
    r = export_cli("--config", "textdet_tiny", "--multirun", "export.sampler=gather,grid_sample",
                   f"hydra.sweep.dir={tmp_path}", "export.lint=false", "verify.sizes=[[160,224]]",
                   "verify.batch=false")
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("sweep summary"):]
    assert "export.sampler=gather" in table and "export.sampler=grid_sample" in table
    assert table.count("True") == 2
    grid = onnx.load(str(tmp_path / "1" / "model.onnx"))
    assert "GridSample" in {n.op_type for n in grid.graph.node}


BAD_INPUTS = {
    "typo in a key": (["export.opsett=16"], "opsett"),
    "missing config file": (["model.d2_config=nowhere/none.yaml"], "no such file"),
    "missing weights": (["model.weights=nowhere/w.pth"], "no such file"),
    "unknown meta-architecture": (["model.opts=[MODEL.META_ARCHITECTURE,NoSuchArch]"], "NoSuchArch"),
    "user code fails to import": (["model.imports=[no_such_module_d2x]"], "no_such_module_d2x"),
    "failed verification": (["verify.atol=0", "verify.rtol=0", "export.lint=false",
                             "verify.sizes=[[160,224]]", "verify.batch=false"], "disagrees"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=lambda c: c.replace(" ", "-"))
def test_bad_input_gives_one_line_error_and_no_output(tmp_path, case):
    overrides, needle = BAD_INPUTS[case]
    out = tmp_path / "run"
    r = export_cli("--config", "textdet_tiny", f"hydra.run.dir={out}", *overrides)
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert not list(out.glob("*.onnx")) and not list(out.glob(".*.onnx")), "a model file was left behind"


@pytest.mark.parametrize("case", ["typo in a key", "missing config file", "missing weights"])
def test_a_config_mistake_is_said_before_torch_is_imported(tmp_path, case):
    """What the config alone shows wrong is said at once: not after the seconds torch, detectron2 and the model code
    take to import."""
    overrides, needle = BAD_INPUTS[case]
    code = ("import sys\nfrom d2export.cli import export_main\ntry:\n    sys.exit(export_main(sys.argv[1:]))\n"
            "finally:\n    print('torch imported' if 'torch' in sys.modules else 'torch not imported')")  # Hydra exits
    r = subprocess.run([sys.executable, "-c", code, "--config", "textdet_tiny", f"hydra.run.dir={tmp_path}",
                        *overrides], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "torch not imported"


def test_bad_config_name_is_one_line(tmp_path):
    r = export_cli("--config", "no_such_config_x")
    assert r.returncode != 0 and "no config 'no_such_config_x'" in r.stderr and "Traceback" not in r.stderr


def test_full_size_default_config_exports_and_verifies(tmp_path):
    """The full-size config (`make export CONFIG=textdet`: TotalText polygon R50, 100 queries), verified at a size and
    aspect it was not traced at; lint, the default's five sizes and batches left to the tiny tests (the same code at
    thinner widths): the full model's eager runs were a third of this test's time."""
    manifest = export("textdet", tmp_path, "export.lint=false", "verify.sizes=[[256,400]]", "verify.batch=false")
    assert manifest.verification["passed"] is True
    assert manifest.outputs[2].shape == ["batch", 100, 16, 2]
    assert {p["name"]: p["sites"] for p in manifest.patches}["msda-core"] == 18  # 6 encoder + 2 x 6 decoder
    assert (tmp_path / "model.onnx").stat().st_size > 150e6
