"""The plugin is invisible to detectron2's own exports: detectron2's export tests (redone offline in
detectron2_export_cases.py) have the same outcomes, bit for bit, with d2export activated and the export patch scope
open as without d2export ever imported. Each side runs in a fresh process (TorchScript caches what it compiled)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import detectron2_export_cases as cases

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("d2_exports")
    runs = {side: (out / f"{side}.pt", subprocess.Popen(
        [sys.executable, str(HERE / "detectron2_export_cases.py"), str(out / f"{side}.pt")] + flags,
        cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for side, flags in (("without", []), ("with", ["--plugin"]))}
    results = {}
    for side, (path, proc) in runs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{side} the plugin: {log[-3000:]}"
        results[side] = torch.load(path, weights_only=False)
    return results


@pytest.mark.parametrize("name", list(cases.CASES))
def test_same_outcome_with_and_without_the_plugin(outcomes, name):
    without, with_plugin = outcomes["without"][name], outcomes["with"][name]
    assert without["passed"] or name in cases.NEEDS_COMPILED_D2, f"the reference run fails: {without['error']}"
    assert with_plugin["passed"] == without["passed"], with_plugin.get("error") or with_plugin.get("where")
    if not without["passed"]:
        assert with_plugin["error"] == without["error"]
        return
    expected, got = without["outputs"], with_plugin["outputs"]
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_the_plugin_run_had_the_export_patches_installed(outcomes):
    report = outcomes["with"]["_report"]
    active = {p["name"] for p in report["patches"] if p["status"] in ("applied", "unused")}
    assert {"adaptive-avg-pool2d", "adaptive-max-pool2d", "sizes-as-tensor", "index-assign"} <= active
    calls = {p["name"]: p["hits"] + p["deferred"] for p in report["patches"]}
    assert calls["sizes-as-tensor"] > 0 and calls["index-assign"] > 0, "detectron2's eager code ran through them"
