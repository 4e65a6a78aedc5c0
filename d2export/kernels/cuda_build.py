"""Which CUDA the fused operator's CUDA kernel library was built with, and whether this machine's driver can run it.

The library links cudart statically, so it needs no CUDA toolkit at run time, only a driver at least as new as its
cudart's major version (cudart 13: R580 or newer). setup.py records the nvcc release beside the library
(`_msda_cuda.build.json`). Where a driver is present but older, the library's CUDA kernel could not run a single call
(cudart fails the launch with "driver version is insufficient"), so d2export registers the CPU library instead: the
node then runs on the CPU kernel inside the CUDA session, slower but right, and one warning says why and what to build.
Where there is no driver at all, nothing can run on a GPU and the CUDA library serves on the CPU as before.
"""
from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path

log = logging.getLogger("d2export")

RECORD_SUFFIX = ".build.json"  # setup.py writes <library stem>.build.json beside the library


def record_path(library: str | Path) -> Path:
    """Where setup.py records the build of `library` (its name up to the first dot, then RECORD_SUFFIX)."""
    path = Path(library)
    return path.with_name(path.name.split(".")[0] + RECORD_SUFFIX)


def built_cuda(library: str | Path) -> tuple[int, int] | None:
    """The CUDA release (major, minor) `library` was built with, None where no readable record says."""
    try:
        release = json.loads(record_path(library).read_text())["cuda"]
        major, minor = (int(part) for part in str(release).split(".")[:2])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return major, minor


def driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA release this machine's NVIDIA driver supports (cuDriverGetVersion), None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, (version.value % 1000) // 10


def runnable(library: str | Path, driver: tuple[int, int] | None = None) -> bool:
    """False where a driver is present but older than the major CUDA release `library` was built with (cudart's
    minor-version compatibility: any driver of the same major runs it); True otherwise, with one warning when false."""
    built = built_cuda(library)
    driver = driver if driver is not None else driver_cuda()
    if built is None or driver is None or driver[0] >= built[0]:
        return True
    log.warning("d2export: the fused operator's CUDA kernel was built with CUDA %d.%d, which this machine's driver "
                "(CUDA %d.%d) cannot run; it runs on the CPU kernel instead. Install a driver for CUDA %d, or build "
                "the wheel with a CUDA %d toolkit (docs/setup.md)", *built, *driver, built[0], driver[0])
    return False
