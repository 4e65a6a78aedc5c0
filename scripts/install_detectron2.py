#!/usr/bin/env python
"""Install detectron2's pure-Python package where detectron2 publishes none for this Python.

detectron2 ships no wheel for Python 3.11. The registry's `sal-detectron2==0.7.2` wheel carries detectron2's own
source (main branch, mid-2024) plus a `_C` binary built for CUDA 12 and an older torch, a stray top-level `tools/`
package and pins (numpy<2, black, tensorboard) that this code does not need. We repack it as a proper
`detectron2` wheel: no `_C`, no `tools/`, `pkg_resources` no longer required, only the dependencies the Python code
imports. pip then knows it (`pip show detectron2`, `pip uninstall detectron2`).

An importable detectron2 (say a user's CUDA build from source) is left alone. `--force` replaces it anyway.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SOURCE = "sal-detectron2==0.7.2"
VERSION = "0.7.2+purepy"  # local label: this is not an upstream release
REQUIRES = [
    "numpy", "Pillow>=7.1", "matplotlib", "pycocotools>=2.0.2", "termcolor>=1.1", "yacs>=0.1.8", "tabulate",
    "cloudpickle", "tqdm>4.29.0", "omegaconf>=2.1,<2.4", "hydra-core>=1.1", "packaging",
    "fvcore>=0.1.5", "iopath>=0.1.7",
]
# detectron2.model_zoo needs pkg_resources for one call, and setuptools>=82 no longer ships it.
PKG_RESOURCES_FIX = (
    "import pkg_resources\n",
    "from importlib import resources as _resources\n",
    'pkg_resources.resource_filename(\n        "detectron2.model_zoo", os.path.join("configs", config_path)\n    )',
    'str(_resources.files("detectron2.model_zoo").joinpath("configs", config_path))',
)


def log(msg: str) -> None:
    print(f"[install_detectron2] {msg}", flush=True)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def keep(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top == "tools" or top.endswith(".dist-info"):
        return False
    return not (name.startswith("detectron2/_C") and name.endswith(".so"))


def fix_model_zoo(text: str) -> str:
    old_import, new_import, old_call, new_call = PKG_RESOURCES_FIX
    if old_import not in text or old_call not in text:
        raise RuntimeError("detectron2/model_zoo/model_zoo.py changed upstream: update PKG_RESOURCES_FIX")
    return text.replace(old_import, new_import).replace(old_call, new_call)


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(src: Path, dst_dir: Path) -> Path:
    dist = f"detectron2-{VERSION}.dist-info"
    out = dst_dir / f"detectron2-{VERSION}-py3-none-any.whl"
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(src) as zin:
        for info in zin.infolist():
            if info.is_dir() or not keep(info.filename):
                continue
            data = zin.read(info)
            if info.filename == "detectron2/model_zoo/model_zoo.py":
                data = fix_model_zoo(data.decode()).encode()
            files[info.filename] = data
        licence = next(n for n in zin.namelist() if n.endswith(".dist-info/LICENSE"))
        files[f"{dist}/LICENSE"] = zin.read(licence)
    meta = [
        "Metadata-Version: 2.1", "Name: detectron2", f"Version: {VERSION}",
        "Summary: detectron2 (pure-Python build, no _C extension), repacked by d2export from " + SOURCE,
        "Home-page: https://github.com/facebookresearch/detectron2", "License: Apache-2.0",
        "Requires-Python: >=3.8", *[f"Requires-Dist: {r}" for r in REQUIRES],
    ]
    files[f"{dist}/METADATA"] = ("\n".join(meta) + "\n").encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: d2export\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist}/top_level.txt"] = b"detectron2\n"
    record = [record_line(n, d) for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for name, data in files.items():
            zout.writestr(name, data)
    return out


def installed() -> bool:
    if importlib.util.find_spec("detectron2") is None:
        return False
    # importable is not enough: a broken build must not pass as installed
    probe = "import detectron2.modeling, detectron2.config"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="replace an importable detectron2")
    ap.add_argument("--wheel", type=Path, help="use this downloaded sal-detectron2 wheel instead of the registry")
    args = ap.parse_args()
    if installed() and not args.force:
        log("detectron2 is importable already: leaving it alone (use --force to replace it)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = args.wheel
        if src is None:
            log(f"downloading {SOURCE} (source of detectron2's pure-Python package)")
            pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.10",
                "--platform", "linux_x86_64", "--implementation", "cp", "--abi", "cp310", SOURCE, "-d", str(tmp))
            src = next(tmp.glob("sal_detectron2-*.whl"))
        wheel = repack(src, tmp)
        log(f"installing {wheel.name} (no _C: CUDA-only ops such as deformable conv are unavailable)")
        pip("install", "--quiet", str(wheel))
    if not installed():
        log("detectron2 was installed but does not import")
        return 1
    log("detectron2 installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
