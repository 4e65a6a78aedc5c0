"""d2export: export detectron2 detectors with deformable attention (TESTR-like text spotters) to ONNX and serve them."""
import os
import re
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

# The fused MSDA operator as a native onnxruntime custom-op library (d2export/runtime/native), built where a C++
# compiler exists; optional, so an install without one still succeeds and the numba kernel (the `fused` extra) serves
# instead. Python never imports it: onnxruntime loads it by path (d2export.runtime.custom_ops finds it). No
# -march=native: a wheel or a clone may move to another CPU; -O3 vectorises the kernel's loop over D for the default
# target.
NATIVE_FLAGS = (["/O2", "/std:c++17"] if os.name == "nt"
                else ["-O3", "-g0", "-std=c++17", "-fvisibility=hidden", "-pthread"])
MSDA_NATIVE = Extension(
    "d2export.runtime._msda_native",
    sources=["d2export/runtime/native/msda_op.cc"],
    depends=["d2export/runtime/native/ort_abi.h"],
    extra_compile_args=NATIVE_FLAGS,
    extra_link_args=[] if os.name == "nt" else ["-pthread"],
    export_symbols=["RegisterCustomOps"],
    language="c++",
    optional=True,
)


class BuildExt(build_ext):
    def get_export_symbols(self, ext):
        """A custom-op library, not a Python module: it exports RegisterCustomOps and no PyInit_ function (which
        build_ext would otherwise ask the Windows linker to export)."""
        return ext.export_symbols


setup(
    name="d2export",
    version=VERSION,
    description=__doc__,
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["d2export", "d2export.*"]),
    package_data={"d2export": ["py.typed"]},
    ext_modules=[MSDA_NATIVE],
    cmdclass={"build_ext": BuildExt},
    install_requires=[
        # detectron2 is required too, but it is not on the registry for every Python: see scripts/install_detectron2.py
        "torch>=2.1",
        "torchvision>=0.16",
        "onnx>=1.15",
        "onnxscript>=0.2",  # the torch.export-based exporter (export.exporter=dynamo)
        *ORT,
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy>=1.23",
        "Pillow>=9.0",
        "pydantic>=2",  # the manifest's schema, checked when read (the serving runtime too)
        "tqdm>=4",  # progress on long steps
    ],
    extras_require={
        "gpu": ["onnxruntime-gpu>=1.17"],
        "serve": ["fastapi>=0.100", "uvicorn>=0.23", "python-multipart>=0.0.6", "prometheus_client>=0.17"],
        "slim": ["onnxslim>=0.1.30"],
        "batch": ["ray[data]>=2.40", "fsspec>=2023.12"],  # `d2export batch`
        # tritonclient: Triton's model-config protobuf, to check the configs triton-repo writes; matplotlib: benchmarks'
        # plots
        "dev": ["pytest>=7", "psutil>=5", "httpx>=0.24", "tritonclient>=2.40", "matplotlib>=3.5",
                # scipy: the TESTR stand-in's Hungarian matcher (third_party/testr, trained in tests)
                "scipy>=1.8"],
        # the fused MSDA operator for onnxruntime on the CPU (export.sampler=fused): its kernel and its registration
        "fused": ["numba>=0.59", "onnxruntime-extensions>=0.15"],
        # `d2export synth`: OpenCV warps words along their curves and traces the visible outlines of shapes
        "synth": ["opencv-python-headless>=4.5"],
        # `d2export evaluate`: polygon areas for the text evaluator (pycocotools comes with detectron2)
        "eval": ["shapely>=2"],
    },
    entry_points={"console_scripts": ["d2export=d2export.cli:main"]},
)
