"""The plugin is invisible to detectron2's own exports: detectron2's export tests (redone offline in
detectron2_export_cases.py) have the same outcomes with d2export activated and a patch scope open as without
d2export ever imported. Each side runs in a fresh process (TorchScript caches what it compiled), all at once.

- `export-scope`: the export pipeline's scope (gather sampler, patches for opset 17 / onnxruntime): outputs equal
  bit for bit.
- `every-patch`: every registered patch installed (target=None), also the ones old opsets and TensorRT need, for
  the scripting and tracing cases: the same outcomes; outputs bit for bit unless a patch rewrote a call in that
  case, then equal to 1e-4.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import detectron2_export_cases as cases

HERE = Path(__file__).resolve().parent
SIDES = {"without": [], "export-scope": ["--plugin", "export-scope"], "every-patch": ["--plugin", "every-patch"]}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("d2_exports")
    runs = {side: subprocess.Popen([sys.executable, str(HERE / "detectron2_export_cases.py"), str(out / side)] + flags,
                                   cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for side, flags in SIDES.items()}
    results = {}
    for side, proc in runs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{side}: {log[-3000:]}"
        results[side] = torch.load(out / side, weights_only=False)
    return results


@pytest.mark.parametrize("side, name", [("export-scope", name) for name in cases.CASES] +
                         [("every-patch", name) for name in cases.EVERY_PATCH_CASES])
def test_same_outcome_with_and_without_the_plugin(outcomes, side, name):
    without, plugin = outcomes["without"][name], outcomes[side][name]
    assert without["passed"] != (name in cases.FAIL_WITHOUT_PLUGIN), without.get("error", "passes")
    assert plugin["passed"] == without["passed"], plugin.get("where")
    if not without["passed"]:
        assert plugin["error"] == without["error"]
        return
    expected, got = without["outputs"], plugin["outputs"]
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        if plugin["rewritten_by"]:
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-4, msg=key)
        else:
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("side", ["export-scope", "every-patch"])
def test_the_plugin_runs_had_the_patches_installed(outcomes, side):
    records = {p["name"]: p for p in outcomes[side]["_report"]["patches"]}
    installed = {name for name, p in records.items() if p["kind"] == "function" and p["sites"] > 0}
    expected = {"adaptive-avg-pool2d", "adaptive-max-pool2d", "sizes-as-tensor", "index-assign", "inverse"}
    if side == "every-patch":
        expected |= {"interpolate-bilinear", "grid-sample", "group-norm", "any", "all", "cross"}
    assert expected <= installed, expected - installed
    assert records["sizes-as-tensor"]["deferred"] > 0 and records["index-assign"]["deferred"] > 0, \
        "detectron2's eager code ran through the wrappers"
