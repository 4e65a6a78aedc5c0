"""d2export's custom onnxruntime operators, and registering them with a session that needs them.

A graph exported with `export.sampler=fused` holds one `d2export.MultiScaleDeformableAttention` node per MSDA call
(inputs value, spatial_shapes, level_start_index, sampling_locations, attention_weights; output [N, Lq, M*D]),
computed on the CPU by a compiled kernel (`msda_kernel`, numba) that onnxruntime-extensions hands to onnxruntime.
The manifest lists the operators a graph needs (`custom_ops`); `register` makes a SessionOptions able to run them.
Both packages come with the `fused` extra; without them, one clear error says so. Imports neither torch nor
onnxruntime-extensions until a graph needs it.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterable

DOMAIN = "d2export"
FUSED_MSDA = "MultiScaleDeformableAttention"
FUSED_MSDA_ID = f"{DOMAIN}.{FUSED_MSDA}"  # how the manifest names it
KNOWN = (FUSED_MSDA_ID,)
EXTRA_HINT = "pip install 'd2export[fused]'"


class MissingExtra(RuntimeError):
    """A graph needs a custom operator whose packages are not installed."""


_SPINNING = "session.intra_op.allow_spinning"
_lock = threading.Lock()
_defined: dict[str, Any] = {}  # what `_define` set up, once per process
_threads = 0  # numba threads for the kernel: the largest intra-op count asked for (0: one per core)


def register(options, ops: Iterable[str]):
    """Make onnxruntime `SessionOptions` able to run `ops` (names as the manifest lists them); returns `options`.
    Nothing happens for a graph that needs none. The kernel uses `options.intra_op_num_threads` threads, and
    onnxruntime's own threads stop spin-waiting between nodes unless the options say otherwise: the kernel runs on
    threads of its own, which spinning pool threads would take the cores from (measured: a fused TESTR image 7-10%
    faster on 2 cores; the default graph, which has no such node, is left spinning)."""
    global _threads
    ops = list(dict.fromkeys(ops))
    if not ops:
        return options
    unknown = [op for op in ops if op not in KNOWN]
    if unknown:
        raise ValueError(f"the model needs custom operator(s) {', '.join(unknown)}, which this d2export does not "
                         f"provide (it has {', '.join(KNOWN)}): upgrade d2export")
    with _lock:
        library = _define()
        _threads = max(_threads, int(options.intra_op_num_threads or 0))
    options.register_custom_ops_library(library)
    try:
        options.get_session_config_entry(_SPINNING)
    except RuntimeError:  # not set by the caller
        options.add_session_config_entry(_SPINNING, "0")
    return options


def file_ops(path) -> list[str]:
    """The custom operators an .onnx file uses."""
    import onnx

    return graph_ops(onnx.load(str(path), load_external_data=False))


def graph_ops(model) -> list[str]:
    """The custom operators an `onnx.ModelProto` uses (for the manifest)."""
    return sorted({f"{n.domain}.{n.op_type}" for n in _all_nodes(model.graph) if n.domain == DOMAIN})


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] * attr.HasField("g") + list(attr.graphs):
                yield from _all_nodes(sub)


def _define() -> str:
    """Declare the operator to onnxruntime-extensions once; the path of its custom-op library."""
    if "library" in _defined:
        return _defined["library"]
    try:
        import numba  # noqa: F401 - the kernel's compiler; imported here to name it when missing
        ortx = _import_extensions()
        from onnxruntime_extensions import PyCustomOpDef, onnx_op
    except ImportError as e:
        raise MissingExtra(f"this model uses d2export's fused MSDA operator ({FUSED_MSDA_ID}), which needs the "
                           f"'fused' extra ({e.name} is not installed): {EXTRA_HINT}") from None
    from d2export.runtime import msda_kernel

    def fused_msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        if _threads:
            msda_kernel.numba.set_num_threads(min(_threads, msda_kernel.numba.config.NUMBA_NUM_THREADS))
        return msda_kernel.msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

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
