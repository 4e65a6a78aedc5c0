"""The fused operator's CUDA library on a driver too old for it: setup.py records the CUDA release it was built with,
and d2export registers the CPU library instead wherever a driver is present but of an older major release (cudart,
linked in, would fail every launch), with one warning naming the fix; no driver, or a new enough one, keeps the CUDA
library (it serves on the CPU too)."""
import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from d2export.kernels import cuda_build, custom_ops


def _library(tmp_path: Path, release) -> Path:
    library = tmp_path / "_msda_cuda.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(b"")
    if release is not None:
        (tmp_path / "_msda_cuda.build.json").write_text(json.dumps({"cuda": release, "sm": [75, 90], "ptx": 90}))
    return library


def test_the_record_beside_the_library_is_read(tmp_path):
    assert cuda_build.built_cuda(_library(tmp_path, "13.0")) == (13, 0)
    (tmp_path / "unrecorded").mkdir()
    assert cuda_build.built_cuda(_library(tmp_path / "unrecorded", None)) is None
    (tmp_path / "_msda_cuda.build.json").write_text("{not json")
    assert cuda_build.built_cuda(tmp_path / "_msda_cuda.cpython-311-x86_64-linux-gnu.so") is None


@pytest.mark.parametrize("driver, expected", [((12, 4), False), ((11, 8), False), ((13, 0), True), ((13, 2), True),
                                              ((14, 0), True)])
def test_a_driver_runs_the_library_from_its_major_release_on(tmp_path, driver, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="d2export"):
        assert cuda_build.runnable(_library(tmp_path, "13.0"), driver) is expected
    warned = [r.getMessage() for r in caplog.records]
    if expected:
        assert not warned
    else:  # one line: what was built, what the driver is, that the CPU kernel serves, what to do
        assert len(warned) == 1 and "CUDA 13.0" in warned[0] and f"CUDA {driver[0]}.{driver[1]}" in warned[0]
        assert "CPU kernel" in warned[0] and f"CUDA {driver[0]} toolkit" in warned[0]


def test_without_a_record_or_a_driver_the_library_is_kept(tmp_path, monkeypatch):
    assert cuda_build.runnable(_library(tmp_path, None), (11, 0)) is True  # a build before records: as before
    monkeypatch.setattr(cuda_build, "driver_cuda", lambda: None)
    assert cuda_build.runnable(_library(tmp_path, "13.0")) is True  # no driver: nothing runs on a GPU anyway


def test_an_old_driver_registers_the_cpu_library_instead(tmp_path, monkeypatch):
    cuda = _library(tmp_path, "13.0")
    native = tmp_path / "_msda_native.cpython-311-x86_64-linux-gnu.so"
    native.write_bytes(b"")
    monkeypatch.setattr(custom_ops, "_built", lambda name: str({custom_ops.CUDA_NAME: cuda,
                                                                  custom_ops.NATIVE_NAME: native}[name]))
    for driver, expected in (((12, 8), native), ((13, 1), cuda), (None, cuda)):
        monkeypatch.setattr(cuda_build, "driver_cuda", lambda driver=driver: driver)
        custom_ops._cuda_runnable.cache_clear()
        assert custom_ops.native_library() == str(expected)
        kernel = custom_ops.serving_kernel([custom_ops.FUSED_MSDA_ID], [custom_ops.CUDA_PROVIDER, "CPUExecutionProvider"])
        assert kernel == ("cuda" if expected == cuda else "native")
    custom_ops._cuda_runnable.cache_clear()


def test_the_built_library_records_the_nvcc_that_built_it():
    library = custom_ops.cuda_library()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if library is None or nvcc is None:
        pytest.skip("no CUDA library built here (tests/test_msda_cuda_build.py fails where nvcc exists without it)")
    release = re.search(r"release (\d+)\.(\d+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                                 text=True).stdout)
    assert cuda_build.built_cuda(library) == (int(release.group(1)), int(release.group(2)))
