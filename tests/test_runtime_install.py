"""Two installs from one package. `pip install d2export` is the serving runtime: built here as a wheel (the native MSDA
library inside it), installed into a fresh venv with only its own requirements (no torch, no detectron2), it serves a
fused graph the full install exported and prints what the full install prints. A command of the export side asked of
the runtime alone says in one line what to install."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from d2export.argparsing import EXPORT_INSTALL, EXPORT_SIDE, export_side_missing
from d2export.resizing import synthetic_image

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_BUDGET_MB = 300  # the goal for a runtime venv (onnxruntime, numpy, Pillow, pydantic, tqdm, onnx, pip)

# --- the export side asked of the runtime alone (an import blocker stands in for an install without it) -------------
BLOCKER = """
import sys
BLOCKED = set(sys.argv[1].split(","))

class Refuse:  # as if these were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
from d2export.cli import main
sys.exit(main(sys.argv[2:]))
"""
RUNTIME_ONLY = ",".join(EXPORT_SIDE)


def _blocked(blocked: str, *argv: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER, blocked, *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("argv", [
    ["export", "--config", "textdet_micro"],
    ["export", "--help"],
    ["diagnose", "--config", "textdet_micro"],
    ["evaluate", "model.onnx", "--dataset", "data/synth_text"],
], ids=lambda a: " ".join(a))
def test_export_side_without_it_is_one_line_naming_the_install(argv):
    done = _blocked(RUNTIME_ONLY, *argv)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"d2export: error: `d2export {argv[0]}` needs the export side") \
        and lines[0].endswith(EXPORT_INSTALL), lines[0]
    assert done.stdout == ""


def test_export_with_only_torch_missing_is_the_same_line():
    """Hydra and omegaconf there, torch not (a partial install): the failure inside Hydra's job says it too."""
    done = _blocked("torch", "export", "--config", "textdet_micro")
    assert done.returncode == 1, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "error" in line] == [
        "d2export: error: `d2export export` needs the export side, which this install lacks (no module named "
        f"'torch'): {EXPORT_INSTALL}"], done.stderr[-3000:]


def test_only_a_missing_top_level_package_is_the_export_side():
    """detectron2._C missing beside an installed detectron2 (a checkout's compiled op) is the checkout's error, not
    the export side's; the line is found through the chain (the export's stage errors wrap it)."""
    assert export_side_missing(ModuleNotFoundError("No module named 'detectron2._C'", name="detectron2._C"),
                               "export") is None
    assert export_side_missing(ModuleNotFoundError("No module named 'timm'", name="timm"), "export") is None
    try:
        try:
            raise ModuleNotFoundError("No module named 'detectron2'", name="detectron2")
        except ModuleNotFoundError as e:
            raise RuntimeError("import: ModuleNotFoundError") from e
    except RuntimeError as e:
        line = export_side_missing(e, "evaluate")
    assert line.startswith("d2export: error: `d2export evaluate` needs the export side") and "install_detectron2" in line


def test_synth_without_opencv_names_its_extra_and_runtime_commands_need_no_export_side(tmp_path):
    done = _blocked(RUNTIME_ONLY + ",cv2", "synth", "text", "--count", "1", "--out", str(tmp_path / "set"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "d2export: error: No module named 'cv2': pip install 'd2export[synth]' (OpenCV draws the sets)"], done.stderr
    for command in ("infer", "serve", "triton-repo", "batch"):
        done = _blocked(RUNTIME_ONLY, command, "--help")
        assert done.returncode == 0 and "usage: d2export" in done.stdout, (command, done.stderr[-2000:])


# --- the runtime wheel in a venv of its own ----------------------------------------------------------------------------
def _du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def _requirements(wheel: Path) -> list[str]:
    """The wheel's own requirements (no extra's), each pinned to the version the full install holds: the two installs
    then compute with the same onnxruntime, numpy and Pillow, so their outputs can be compared for equality."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    plain = [r for r in requires if "extra ==" not in r]
    names = [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in plain]
    pinned = []
    for name, requirement in zip(names, plain):
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(requirement)
    return pinned


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory, pytestconfig):
    """The wheel built from this checkout (D2EXPORT_CUDA=0: nvcc has no part in the suite; `make wheel` builds the
    CUDA library too) and a fresh venv holding it and its requirements alone. Built once per run."""
    root = tmp_path_factory.mktemp("runtime_install")
    timings = {}
    # a copy of what the wheel is made of, so that the build leaves no build/ in the checkout and takes none of the
    # libraries built in place there
    source = root / "source"
    source.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "d2export", source / "d2export",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))} | {"D2EXPORT_CUDA": "0"}
    start = time.perf_counter()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(root / "dist"), str(source)], capture_output=True, text=True, env=env)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    wheel = next((root / "dist").glob("d2export-*.whl"))
    timings["wheel"] = time.perf_counter() - start

    venv = root / "venv"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, env=env)
    python = venv / "bin" / "python"
    timings["venv"] = time.perf_counter() - start
    requirements = _requirements(wheel)
    assert not [r for r in requirements if re.split(r"[=<>!~ ;\[]", r)[0].lower().replace("-", "_") in
                {"torch", "torchvision", "onnxscript", "hydra_core", "omegaconf", "detectron2"}], requirements
    start = time.perf_counter()
    for args in (requirements, ["--no-deps", str(wheel)]):
        done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True,
                              env=env)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    timings["pip install"] = time.perf_counter() - start
    size = _du_mb(venv)
    line = (f"runtime venv: {size:.0f} MB ({' '.join(requirements)}); wheel {wheel.name} "
            f"{wheel.stat().st_size / 2**20:.1f} MB; " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + line)  # shown even when the tests pass
    return {"python": python, "d2export": venv / "bin" / "d2export", "wheel": wheel, "size_mb": size, "env": env,
            "root": root}


def test_the_wheel_carries_the_native_library_and_requires_no_export_side(runtime_venv):
    with zipfile.ZipFile(runtime_venv["wheel"]) as z:
        names = z.namelist()
    assert [n for n in names if re.fullmatch(r"d2export/kernels/_msda_native[^/]*\.so", n)], names
    assert not [n for n in names if "_msda_cuda" in n]  # D2EXPORT_CUDA=0
    assert not [n for n in names if n.startswith(("tests/", "third_party/", "configs/"))]


def test_runtime_venv_has_no_torch_and_fits_its_budget(runtime_venv):
    done = subprocess.run([str(runtime_venv["python"]), "-c", "import torch"], capture_output=True, text=True)
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr, done.stderr
    for absent in ("detectron2", "hydra", "numba", "onnxruntime_extensions"):
        assert subprocess.run([str(runtime_venv["python"]), "-c", f"import {absent}"],
                              capture_output=True).returncode != 0, absent
    assert runtime_venv["size_mb"] < RUNTIME_BUDGET_MB, runtime_venv["size_mb"]


def test_runtime_install_export_is_one_line_naming_the_install(runtime_venv, tmp_path):
    done = subprocess.run([str(runtime_venv["d2export"]), "export", "--config", str(ROOT / "configs" /
                                                                                     "textdet_micro.yaml")],
                          capture_output=True, text=True, cwd=tmp_path, env=runtime_venv["env"])
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"d2export: error: `d2export export` needs the export side, which this install lacks (no module named "
        f"'omegaconf'): {EXPORT_INSTALL}"], done.stderr[-3000:]


def test_runtime_install_serves_the_fused_graph_as_the_full_install_does(runtime_venv, fixed_fused_export, tmp_path):
    """The full install exported it (verified); the runtime alone serves it with the wheel's native library and prints
    the very JSON lines the full install prints."""
    manifest, model = fixed_fused_export
    assert manifest.sampler == "fused"
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for name, (h, w) in {"a.png": (160, 224), "b.png": (200, 130)}.items():
        Image.fromarray(synthetic_image(h, w, seed=len(name) + h).transpose(1, 2, 0)).save(pictures / name)
    args = ["infer", str(model), str(pictures), "--threads", "1", "--no-progress"]
    full = subprocess.run([sys.executable, "-m", "d2export.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    alone = subprocess.run([str(runtime_venv["d2export"]), *args], capture_output=True, text=True, cwd=tmp_path,
                           env=runtime_venv["env"])
    assert full.returncode == 0, full.stderr[-3000:]
    assert alone.returncode == 0, alone.stderr[-3000:]
    records = [json.loads(line) for line in alone.stdout.splitlines()]
    assert len(records) == 2 and all(r.get("instances") for r in records), alone.stdout[:2000]
    assert alone.stdout == full.stdout
    kernel = subprocess.run([str(runtime_venv["python"]), "-c", "from d2export.kernels import custom_ops; "
                             "print(custom_ops.kernel().library)"], capture_output=True, text=True, cwd=tmp_path)
    library = Path(kernel.stdout.strip())
    assert kernel.returncode == 0 and library.name.startswith("_msda_native"), kernel.stderr[-2000:]
    assert library.is_relative_to(runtime_venv["root"] / "venv")  # the wheel's own, not the checkout's
    assert np.isfinite([i["score"] for r in records for i in r["instances"]]).all()
