"""onnxruntime sessions that open in a fraction of a second the second time: an optimized-model cache beside the model.

Building a session for an exported detector spends seconds optimising the graph (thousands of shape-arithmetic nodes
folded, fused, laid out for this CPU). The first session on a machine saves the optimised graph beside the model
(`.<model file>.ort-cache/<key>.onnx`); later ones load it with optimisation off. The key covers the model file
(size, modification time), the onnxruntime version and this CPU, since the optimised graph may use kernels and
layouts chosen for it. CPU provider only (others optimise for their device); where the folder cannot be written,
sessions are built as usual. D2EXPORT_SESSION_CACHE=0 turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)
CPU = "CPUExecutionProvider"


def create_session(model_path: str | os.PathLike, options, providers: Sequence[str], **kwargs):
    """`onnxruntime.InferenceSession(model_path, options, providers, **kwargs)`, through the cache where it applies."""
    import onnxruntime as ort

    model_path = Path(model_path)
    if list(providers) != [CPU] or os.environ.get("D2EXPORT_SESSION_CACHE", "1") == "0":
        return ort.InferenceSession(str(model_path), options, providers=list(providers), **kwargs)
    cached = cache_path(model_path, options)
    if cached.is_file():
        level = options.graph_optimization_level
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            return ort.InferenceSession(str(cached), options, providers=[CPU], **kwargs)
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt, never a reason to fail
            log.warning("ignoring the optimized-model cache %s (%s)", cached, str(e).splitlines()[0])
            cached.unlink(missing_ok=True)
            options.graph_optimization_level = level
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(exist_ok=True)
        options.optimized_model_filepath = str(tmp)
    except OSError:  # a read-only model folder: no cache
        return ort.InferenceSession(str(model_path), options, providers=[CPU], **kwargs)
    session = ort.InferenceSession(str(model_path), options, providers=[CPU], **kwargs)
    try:
        for stale in cached.parent.glob("*.onnx"):
            stale.unlink(missing_ok=True)
        os.replace(tmp, cached)
    except OSError as e:
        log.info("optimized-model cache not written: %s", e)
        tmp.unlink(missing_ok=True)
    return session


def cache_path(model_path: Path, options) -> Path:
    st = model_path.stat()
    import onnxruntime as ort

    key = "|".join(map(str, (st.st_size, st.st_mtime_ns, ort.__version__, int(options.graph_optimization_level),
                             _cpu_identity(), *_settings(options))))
    return model_path.parent / f".{model_path.name}.ort-cache" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".onnx")


def _settings(options) -> list[str]:
    """The session config entries d2export sets that change the optimised graph (an entry never set reads "")."""
    from d2export.runtime.providers import DISABLED_OPTIMIZERS_KEY, EXACT_INT8_KEY, config_entry

    return [config_entry(options, DISABLED_OPTIMIZERS_KEY), config_entry(options, EXACT_INT8_KEY)]


def _cpu_identity() -> str:
    from d2export.cpu import first_processor

    fields = first_processor()
    if not fields:
        return f"{platform.machine()}|{platform.processor()}"
    return "|".join(fields[k] for k in ("vendor_id", "model name", "flags") if k in fields)
