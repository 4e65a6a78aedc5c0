"""d2export: export detectron2 detectors with deformable attention (TESTR-like text spotters) to ONNX and serve them."""
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "d2export" / "__init__.py").read_text()).group(1)


def has_dist(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


# onnxruntime and onnxruntime-gpu both provide the `onnxruntime` module and must not be installed together: take the
# GPU build where it is installed already or asked for (D2EXPORT_ONNXRUNTIME=gpu, with the `gpu` extra).
WANT_GPU = os.environ.get("D2EXPORT_ONNXRUNTIME") == "gpu" or has_dist("onnxruntime-gpu")
ORT = [] if WANT_GPU else ["onnxruntime>=1.17"]

# The fused MSDA operator as a native onnxruntime custom-op library (d2export/kernels/native), built where a C++
# compiler exists; optional, so an install without one still succeeds and the numba kernel (the `fused` extra) serves
# instead. Python never imports it: onnxruntime loads it by path (d2export.kernels.custom_ops finds it). No
# -march=native: a wheel or a clone may move to another CPU; -O3 vectorises the kernel's loop over D for the default
# target. The flags live in d2export/kernels/native_build.py (no multiply-add contraction: every CPU computes the same
# bits), which the tests build each clone's level with; loaded by path, as d2export is not installed yet.
def _native_build():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_d2export_native_build", HERE / "d2export/kernels/native_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NATIVE_FLAGS = _native_build().NATIVE_FLAGS
MSDA_NATIVE = Extension(
    "d2export.kernels._msda_native",
    sources=["d2export/kernels/native/msda_op.cc"],
    depends=["d2export/kernels/native/ort_abi.h", "d2export/kernels/native/msda_sample.h",
             "d2export/kernels/native/msda_op.h", "d2export/kernels/native/msda_rows.h",
             "d2export/kernels/native_build.py"],
    extra_compile_args=NATIVE_FLAGS,
    extra_link_args=[] if os.name == "nt" else ["-pthread"],
    export_symbols=["RegisterCustomOps"],
    language="c++",
    optional=True,
)


# The same library with the operator's CUDA kernel beside the CPU one (d2export/kernels/native/msda_op_cuda.cu), built
# where nvcc is found (find_nvcc): d2export/kernels/_msda_cuda*.so, which d2export registers instead of _msda_native
# where it exists (its CPU kernel is the same code, built with the same flags). Machine code for every GPU a server is
# likely to hold: sm_75 (T4), sm_80 (A100, A30), sm_86 (A10, A40, RTX 30xx/A-series), sm_89 (L4, L40S, RTX 40xx/Ada)
# and sm_90 (H100, H200), plus sm_90 PTX that newer GPUs (Blackwell) compile when they load it; cudart linked
# statically, so it needs only a driver of nvcc's major release (CUDA 13: R580 or newer; recorded beside it in
# _msda_cuda.build.json, and an older driver gets the CPU library instead), and only once a CUDA session runs it (it
# loads into a CPU-only onnxruntime without one). Optional twice over: no nvcc, a failing nvcc, Windows or macOS, or
# D2EXPORT_CUDA=0 leaves the CPU library alone, with one line saying so.
CUDA_SOURCE = "d2export/kernels/native/msda_op_cuda.cu"
CUDA_RECORD = "_msda_cuda.build.json"  # d2export.kernels.cuda_build reads it
CUDA_SM = (75, 80, 86, 89, 90)
CUDA_ARCHS = [flag for sm in CUDA_SM for flag in ("-gencode", f"arch=compute_{sm},code=sm_{sm}")] + [
    "-gencode", f"arch=compute_{CUDA_SM[-1]},code=compute_{CUDA_SM[-1]}"]
NATIVE_HEADERS = ["d2export/kernels/native/ort_abi.h", "d2export/kernels/native/msda_op.h",
                  "d2export/kernels/native/msda_sample.h", "d2export/kernels/native/msda_rows.h"]
MSDA_CUDA = Extension(
    "d2export.kernels._msda_cuda",
    sources=["d2export/kernels/native/msda_op.cc"],  # plus CUDA_SOURCE, which BuildExt hands to nvcc
    depends=NATIVE_HEADERS + [CUDA_SOURCE, "setup.py", "d2export/kernels/native_build.py"],  # setup.py: CUDA_ARCHS
    define_macros=[("D2_MSDA_CUDA", "1")],
    extra_compile_args=NATIVE_FLAGS,
    export_symbols=["RegisterCustomOps"],
    language="c++",
    optional=True,
)
WANT_CUDA = os.name != "nt" and sys.platform != "darwin" and os.environ.get("D2EXPORT_CUDA", "1") != "0"


def find_nvcc() -> "str | None":
    """$CUDA_HOME's (or $CUDA_PATH's) nvcc where set, so that `CUDA_HOME=/usr/local/cuda-12.8 make wheel` builds for
    CUDA 12 drivers whatever PATH holds; else PATH's; else /usr/local/cuda's."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [home and Path(home) / "bin" / "nvcc", shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((str(c) for c in candidates if c and Path(c).is_file()), None)


class BuildExt(build_ext):
    def get_export_symbols(self, ext):
        """A custom-op library, not a Python module: it exports RegisterCustomOps and no PyInit_ function (which
        build_ext would otherwise ask the Windows linker to export)."""
        return ext.export_symbols

    def build_extension(self, ext):
        if ext.name != MSDA_CUDA.name:
            return super().build_extension(ext)
        nvcc = find_nvcc()
        if nvcc is None:
            print("d2export: no nvcc found, so the MSDA operator's CUDA kernel is not built (the CPU kernel serves)")
            return None
        try:
            self._build_cuda(ext, nvcc)
        except Exception as e:  # noqa: BLE001 - whatever nvcc or the linker says, the install goes on without it
            last = (getattr(e, "output", None) or str(e)).strip().splitlines() or [type(e).__name__]
            print(f"d2export: the MSDA operator's CUDA kernel was not built ({last[-1][:300]}); the CPU kernel serves")
        return None

    def _build_cuda(self, ext, nvcc: str) -> None:
        """msda_op.cc by the C++ compiler with the CPU library's flags, msda_op_cuda.cu by nvcc, linked by nvcc."""
        try:
            from setuptools.modified import newer_group  # setuptools 69 and newer
        except ImportError:
            from distutils.dep_util import newer_group

        target = self.get_ext_fullpath(ext.name)
        if not (self.force or newer_group(ext.sources + list(ext.depends), target, "newer")):
            return
        temp = Path(self.build_temp) / "msda_cuda"
        temp.mkdir(parents=True, exist_ok=True)
        objects = self.compiler.compile(ext.sources, output_dir=str(temp), macros=ext.define_macros,
                                        extra_postargs=ext.extra_compile_args, depends=ext.depends)
        cuda_object = str(temp / "msda_op_cuda.o")
        # -fmad=false: no multiply-add contracted but those the sampling header writes out, as the CPU kernel
        # computes (same roundings, same outputs); the host side compiled as the CPU library is (NATIVE_FLAGS)
        host = ",".join(["-fPIC"] + [f for f in NATIVE_FLAGS if f.startswith(("-fvisibility", "-ffp-contract",
                                                                               "-frecord"))])
        common = ["-std=c++17", "-O3", "-fmad=false", "-DD2_MSDA_CUDA=1", "-Xcompiler", host]
        run = dict(check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        subprocess.run([nvcc, "-c", CUDA_SOURCE, "-o", cuda_object, *common, *CUDA_ARCHS], **run)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        # --exclude-libs: the static cudart's symbols stay inside the library (only RegisterCustomOps is exported)
        subprocess.run([nvcc, "-shared", "-cudart", "static", "-o", target, *objects, cuda_object,
                        "-Xcompiler", "-pthread", "-Xlinker", "--exclude-libs,ALL"], **run)
        # the CUDA release beside the library: d2export.kernels.cuda_build keeps a too-old driver off its CUDA kernel
        release = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], **run).stdout)
        record = {"cuda": release.group(1) if release else None, "sm": list(CUDA_SM), "ptx": CUDA_SM[-1]}
        (Path(target).parent / CUDA_RECORD).write_text(json.dumps(record) + "\n")

    def copy_extensions_to_source(self):
        """--inplace (and `pip install -e`): the libraries are built under build/ and copied beside their package;
        the CUDA library's record goes with it."""
        super().copy_extensions_to_source()
        record = Path(self.build_lib, *MSDA_CUDA.name.split(".")[:-1], CUDA_RECORD)
        if record.is_file():
            shutil.copyfile(record, HERE.joinpath(*MSDA_CUDA.name.split(".")[:-1], CUDA_RECORD))


setup(
    name="d2export",
    version=VERSION,
    description=__doc__,
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["d2export", "d2export.*"]),
    # the OpenVINO extension is built where it is used, from these (d2export/kernels/openvino_extension.py)
    package_data={"d2export": ["py.typed", "kernels/native/*.h", "kernels/native/msda_openvino.cc"]},
    ext_modules=[MSDA_NATIVE] + [MSDA_CUDA] * WANT_CUDA,
    cmdclass={"build_ext": BuildExt},
    # `pip install d2export` is the serving runtime (infer, serve, triton-repo, batch with its extra): d2export.runtime
    # imports neither torch nor detectron2 (tests/test_runtime_install.py installs it alone and serves a fused graph).
    # onnx: a lone .onnx served from the manifest inside it (--embedded-manifest) is read with it.
    install_requires=[
        *ORT,
        "onnx>=1.15",
        "numpy>=1.23",
        "Pillow>=9.0",
        "pydantic>=2",  # the manifest's schema, checked when read
        "tqdm>=4",  # progress on long steps
        "threadpoolctl>=3.1",  # segmentation post-processing: one BLAS thread per band thread
    ],
    extras_require={
        # exporting, verifying, diagnosing, evaluating and training: `pip install 'd2export[export]'`. detectron2 is
        # needed too, but it is not on the registry for every Python: see scripts/install_detectron2.py
        "export": ["torch>=2.1", "torchvision>=0.16", "onnx>=1.15",
                   "onnxscript>=0.2",  # the torch.export-based exporter (export.exporter=dynamo)
                   "hydra-core>=1.3", "omegaconf>=2.3"],
        "gpu": ["onnxruntime-gpu>=1.17"],
        "serve": ["fastapi>=0.100", "uvicorn>=0.23", "python-multipart>=0.0.6", "prometheus_client>=0.17"],
        "slim": ["onnxslim>=0.1.30"],
        "batch": ["ray[data]>=2.40", "fsspec>=2023.12"],  # `d2export batch`
        # tritonclient: Triton's model-config protobuf, to check the configs triton-repo writes; matplotlib: benchmarks'
        # plots
        "dev": ["pytest>=7", "pytest-xdist>=3.6",  # --no-loadscope-reorder: `make test`
                "psutil>=5", "httpx>=0.24", "tritonclient>=2.40", "matplotlib>=3.5",
                # scipy: the TESTR stand-in's Hungarian matcher (third_party/testr, trained in tests)
                "scipy>=1.8",
                # timm: what the backbones of deployed checkpoints import (detectron2's ViT its Mlp and DropPath,
                # Mask2Former's and DeepSolo's Swin DropPath), as every install of those projects has it
                "timm>=0.9"],
        # the fused MSDA operator for onnxruntime on the CPU (export.sampler=fused): its kernel and its registration
        "fused": ["numba>=0.59", "onnxruntime-extensions>=0.15"],
        # export.bf16: the float32 graph served in bfloat16 by OpenVINO's own runtime on CPUs with AVX512-BF16 or
        # AMX-BF16 (onnxruntime's CPU provider has no bfloat16 GEMM); not onnxruntime-openvino, which would replace
        # onnxruntime. The range d2export was verified with (2026.4)
        "openvino": ["openvino>=2026.4,<2027"],
        # `d2export synth`: OpenCV warps words along their curves and traces the visible outlines of shapes
        "synth": ["opencv-python-headless>=4.5"],
        # `d2export evaluate`: polygon areas for the text evaluator (pycocotools comes with detectron2)
        "eval": ["shapely>=2"],
    },
    entry_points={"console_scripts": ["d2export=d2export.cli:main"]},
)
