"""The fused MSDA operator for OpenVINO: an extension library (native/msda_openvino.cc) that lets OpenVINO read and
run a graph exported with `export.sampler=fused`, computing the rows the onnxruntime library computes.

It is built on first use, not by setup.py: it must match the OpenVINO installed beside d2export (its C++ ABI and
library version), which a user may install or upgrade after d2export, and pip builds d2export where OpenVINO is
absent. The build takes seconds, needs a C++ compiler and the headers the openvino wheel ships, and is kept in
d2export's cache folder (`D2EXPORT_CACHE`, else ~/.cache/d2export) under a name that changes with the sources, the
flags and OpenVINO's version. Torch-free.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from d2export.kernels import native_build

CACHE_ENV = "D2EXPORT_CACHE"
_lock = threading.Lock()


class ExtensionUnavailable(RuntimeError):
    """The extension cannot be built here (no compiler, no OpenVINO development files)."""


def cache_folder() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "d2export")


def library() -> str:
    """The extension's path, built here once per OpenVINO version and source (ExtensionUnavailable, in one line
    saying what to do, where it cannot be)."""
    import openvino

    openvino_dir = Path(openvino.__file__).resolve().parent
    key = hashlib.sha256(openvino.__version__.encode())
    for source in sorted(native_build.NATIVE.glob("*.h")) + [native_build.OPENVINO_SOURCE]:
        key.update(source.read_bytes())
    key.update(" ".join(native_build.NATIVE_FLAGS).encode())
    target = cache_folder() / f"msda_openvino-{key.hexdigest()[:16]}.so"
    with _lock:
        if not target.is_file():
            partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
            try:  # built aside and renamed: another process never loads half a library
                native_build.build_openvino(partial, openvino_dir)
                os.replace(partial, target)
            except RuntimeError as e:
                raise ExtensionUnavailable(
                    "the fused MSDA operator (export.sampler=fused) under OpenVINO needs d2export's extension, which "
                    f"could not be built here ({str(e).splitlines()[0]}): install a C++ compiler, or export with "
                    "export.sampler=gather") from None
            finally:
                partial.unlink(missing_ok=True)
    return str(target)
