"""d2export's custom onnxruntime operators, and registering them with a session that needs them.

A graph exported with `export.sampler=fused` holds one `d2export.MultiScaleDeformableAttention` node per MSDA call
(inputs value, spatial_shapes, level_start_index, sampling_locations, attention_weights; output [N, Lq, M*D]). Two
kernels compute it on the CPU, the same way:
- "native": a C++ custom-op library (d2export/kernels/native) that setup.py builds beside this module where a compiler
  exists; onnxruntime loads it and runs it on the session's own intra-op threads. Where nvcc was found too, setup.py
  builds the same library with a CUDA kernel beside the CPU one (`_msda_cuda*`), registered instead: a CPU session
  still runs the CPU kernel ("native"), a session on onnxruntime's CUDA provider runs the CUDA one ("cuda"). Both
  also take float16 (value and output float16 with float32 or float16 locations and weights: a float16 graph's fused
  node with export.fp16_fused=float16);
- "numba": a compiled numba kernel (`msda_kernel`) that onnxruntime-extensions hands to onnxruntime (the `fused` extra).
The native one serves where it is built, numba otherwise; `D2EXPORT_MSDA_KERNEL=native|numba` forces one (tests,
benchmarks). The manifest lists the operators a graph needs (`custom_ops`); `register` makes a SessionOptions able to
run them; `kernel` says which kernel that is. Imports neither torch nor onnxruntime-extensions until a graph needs
the numba kernel; without either kernel, one clear error says what to install.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from d2export.kernels import cuda_build

DOMAIN = "d2export"
FUSED_MSDA = "MultiScaleDeformableAttention"
FUSED_MSDA_ID = f"{DOMAIN}.{FUSED_MSDA}"  # how the manifest names it
KNOWN = (FUSED_MSDA_ID,)
EXTRA_HINT = "pip install 'd2export[fused]'"
KERNEL_ENV = "D2EXPORT_MSDA_KERNEL"
KERNELS = ("native", "numba")
NATIVE_NAME = "_msda_native"  # setup.py's Extension d2export.kernels._msda_native
CUDA_NAME = "_msda_cuda"  # setup.py's Extension d2export.kernels._msda_cuda: the same library plus the CUDA kernel
CUDA_PROVIDER = "CUDAExecutionProvider"


class MissingExtra(RuntimeError):
    """A graph needs a custom operator whose packages are not installed."""


class Kernel(NamedTuple):
    name: str  # "native" or "numba"
    library: str  # the custom-op library onnxruntime loads for it


_SPINNING = "session.intra_op.allow_spinning"
_lock = threading.Lock()
_defined: dict[str, Any] = {}  # what `_define` set up, once per process
_threads = 0  # numba threads for the kernel: the largest intra-op count asked for (0: one per core)


def register(options, ops: Iterable[str]):
    """Make onnxruntime `SessionOptions` able to run `ops` (names as the manifest lists them); returns `options`.
    Nothing happens for a graph that needs none. The kernel (see `kernel`) uses `options.intra_op_num_threads`
    threads. For the numba kernel, onnxruntime's own threads also stop spin-waiting between nodes unless the options
    say otherwise: that kernel runs on threads of its own, which spinning pool threads would take the cores from
    (measured: a fused TESTR image 7-10% faster on 2 cores). The native kernel runs on the pool's threads themselves,
    so spinning is left as it is (as for the default graph, which has no such node)."""
    global _threads
    ops = list(dict.fromkeys(ops))
    if not ops:
        return options
    unknown = [op for op in ops if op not in KNOWN]
    if unknown:
        raise ValueError(f"the model needs custom operator(s) {', '.join(unknown)}, which this d2export does not "
                         f"provide (it has {', '.join(KNOWN)}): upgrade d2export")
    chosen = kernel()
    options.register_custom_ops_library(chosen.library)
    if chosen.name == "numba":
        with _lock:
            _threads = max(_threads, int(options.intra_op_num_threads or 0))
        try:
            options.get_session_config_entry(_SPINNING)
        except RuntimeError:  # not set by the caller
            options.add_session_config_entry(_SPINNING, "0")
    return options


def kernel() -> Kernel:
    """The kernel `register` gives the fused MSDA operator here: native where its library is built, numba otherwise,
    or the one `D2EXPORT_MSDA_KERNEL` names. Declares the numba kernel to onnxruntime-extensions when it is the one
    (MissingExtra if neither kernel is installed)."""
    forced = os.environ.get(KERNEL_ENV, "").strip().lower()
    if forced and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={forced!r}: expected one of {', '.join(KERNELS)} (or unset: native where "
                         "it is built, else numba)")
    native = native_library()
    if forced == "native" and native is None:
        raise MissingExtra(f"{KERNEL_ENV}=native, but d2export's native MSDA library is not built (no "
                           f"{NATIVE_NAME}* library in {Path(__file__).parent}): reinstall d2export where a C++ "
                           "compiler exists (pip install -e .), or unset it for the numba kernel")
    if native is not None and forced != "numba":
        return Kernel("native", native)
    with _lock:
        return Kernel("numba", _define(native_built=native is not None))


def serving_kernel(ops: Iterable[str], providers: Iterable[str] | None = None) -> str | None:
    """The kernel ("native", "numba" or "cuda") that serves the fused operator among `ops` (as the manifest lists
    them) in a session on `providers` (onnxruntime's names, as `session.get_providers()` gives them; None: the CPU
    provider); None when they hold none. "cuda" where the session runs onnxruntime's CUDA provider and the registered
    library has the CUDA kernel (onnxruntime places the node there); the CPU kernel stays "native"."""
    if FUSED_MSDA_ID not in ops:
        return None
    chosen = kernel()
    if chosen.name == "native" and CUDA_PROVIDER in (providers or ()) and _is_cuda_build(chosen.library):
        return "cuda"
    return chosen.name


@contextlib.contextmanager
def forcing(name: str | None):
    """Within the block, `register` gives the operator the kernel `name` ("native", "numba"; None: the default):
    what D2EXPORT_MSDA_KERNEL says, for benchmarks that time both kernels in one process."""
    before = os.environ.pop(KERNEL_ENV, None)
    if name:
        os.environ[KERNEL_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(KERNEL_ENV, None)
        if before is not None:
            os.environ[KERNEL_ENV] = before


def native_library() -> str | None:
    """The native MSDA library's path, where setup.py built it (beside this module), else None: the build with the
    CUDA kernel where there is one (it holds the same CPU kernel, and loads without a GPU or a driver) unless this
    machine's driver is too old for its cudart (cuda_build), else the CPU build. The library does not depend on Python's ABI, so a build under another Python's suffix serves too."""
    cuda = cuda_library()
    if cuda and _cuda_runnable(cuda):
        return cuda
    return _built(NATIVE_NAME) or cuda


@functools.lru_cache(maxsize=None)
def _cuda_runnable(library: str) -> bool:
    """Once per process (it warns when false): see cuda_build.runnable."""
    return cuda_build.runnable(library)


def cuda_library() -> str | None:
    """The native library built with the CUDA kernel (where setup.py found nvcc), else None."""
    return _built(CUDA_NAME)


def _built(name: str) -> str | None:
    here = Path(__file__).resolve().parent
    exact = [here / f"{name}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    others = sorted(here.glob(f"{name}*.so")) + sorted(here.glob(f"{name}*.pyd"))
    return next((str(p) for p in exact + others if p.is_file()), None)


def _is_cuda_build(library: str) -> bool:
    return Path(library).name.startswith(CUDA_NAME)


def file_ops(path) -> list[str]:
    """The custom operators an .onnx file uses."""
    import onnx

    return graph_ops(onnx.load(str(path), load_external_data=False))


def graph_ops(model) -> list[str]:
    """The custom operators an `onnx.ModelProto` uses (for the manifest)."""
    return sorted({f"{n.domain}.{n.op_type}" for n in _all_nodes(model.graph) if n.domain == DOMAIN})


FUSED_MSDA_INPUTS = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")


def fused_msda_model(value: str = "float", sampling: str = "float") -> bytes:
    """A graph of one fused MSDA node (inputs named FUSED_MSDA_INPUTS, output "out"), for measuring and testing the
    kernels alone. `value`: the value's and output's element type ("float" or "float16"); `sampling`: the locations'
    and weights'. Inputs have no declared rank, so that bad shapes reach the kernel's own checks."""
    from onnx import TensorProto, helper

    kinds = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
    types = [kinds[value], TensorProto.INT64, TensorProto.INT64, kinds[sampling], kinds[sampling]]
    node = helper.make_node(FUSED_MSDA, list(FUSED_MSDA_INPUTS), ["out"], domain=DOMAIN)
    graph = helper.make_graph([node], "msda", [helper.make_tensor_value_info(n, t, None)
                                               for n, t in zip(FUSED_MSDA_INPUTS, types)],
                              [helper.make_tensor_value_info("out", kinds[value], None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] * attr.HasField("g") + list(attr.graphs):
                yield from _all_nodes(sub)


def _define(native_built: bool = False) -> str:
    """Declare the operator to onnxruntime-extensions once; the path of its custom-op library."""
    if "library" in _defined:
        return _defined["library"]
    try:
        import numba  # noqa: F401 - the kernel's compiler; imported here to name it when missing
        ortx = _import_extensions()
        from onnxruntime_extensions import PyCustomOpDef, onnx_op
    except ImportError as e:
        native = "" if native_built else " (or reinstall d2export where a C++ compiler exists, for its native kernel)"
        raise MissingExtra(f"this model uses d2export's fused MSDA operator ({FUSED_MSDA_ID}), which needs the "
                           f"'fused' extra ({e.name} is not installed): {EXTRA_HINT}{native}") from None
    from d2export.kernels import numba_msda

    def fused_msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        if _threads:
            numba_msda.numba.set_num_threads(min(_threads, numba_msda.numba.config.NUMBA_NUM_THREADS))
        return numba_msda.msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    f, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64
    op = onnx_op(op_type=f"{DOMAIN}::{FUSED_MSDA}", inputs=[f, i64, i64, f, f], outputs=[f])(fused_msda)
    _hand_back_arrays(ortx, PyCustomOpDef, op)
    _defined.update(op=op, library=ortx.get_library_path())
    return _defined["library"]


def _import_extensions():
    """onnxruntime_extensions imports torch where it can, for converters this operator does not use: 2.4 s and
    ~650 MB in a serving process that has no other use for torch (and the runtime stays torch-free). torch is hidden
    during that import unless it is loaded already; its converters then report torch missing in this process."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which the package expects
    try:
        import onnxruntime_extensions
    finally:
        if hide and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return onnxruntime_extensions


def _hand_back_arrays(ortx, PyCustomOpDef, op) -> None:
    """onnxruntime-extensions' own call hook returns outputs as Python lists (`tolist()`: 8x the whole operator's time
    for an encoder call); its C++ side takes any array. Answer calls to our operator with the array itself and hand every
    other Python operator to its hook as before. Left as it is if that hook is not where this version keeps it."""
    default = getattr(getattr(ortx, "_ocos", None), "_on_pyop_invocation", None)
    if default is None:
        return
    our_id = op._nativedef.obj_id

    def hook(k_id, feed, attributes):
        if k_id != our_id:
            return default(k_id, feed, attributes)
        out = op.body(*feed)
        return k_id, out.shape, out

    PyCustomOpDef.install_hooker(hook)
