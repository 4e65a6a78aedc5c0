"""Execution providers and what a session gets on each: the providers asked for resolved against this onnxruntime,
each provider's options and the graph transformers turned off, the same for the Predictor and for verification."""
from __future__ import annotations

from typing import Sequence

from d2export import cpu

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


class ProviderUnavailable(RuntimeError):
    pass


def resolve_providers(names: Sequence[str]) -> list[str]:
    """Short names (cpu, cuda, tensorrt) or onnxruntime's own → provider names, refusing any not installed.
    The CPU provider is appended as the fallback for nodes the others do not take."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    chosen = []
    for name in names:
        full = PROVIDERS.get(name.lower(), name)
        if full not in available:
            hint = " (install onnxruntime-gpu with a matching CUDA/TensorRT)" if full != PROVIDERS["cpu"] else ""
            raise ProviderUnavailable(f"execution provider {name!r} ({full}) was asked for, but this onnxruntime "
                                      f"{ort.__version__} offers only {', '.join(available)}{hint}")
        chosen.append(full)
    return list(dict.fromkeys(chosen + [PROVIDERS["cpu"]]))


# onnxruntime's graph transformer that turns MatMul + Add on known shapes into Gemm: on CUDA the Gemm first writes its
# bias into the output with a broadcast kernel (`BroadcastBiasKernel`: 6.4 of 62.8 ms a call measured, float16 batch
# 8 on an H200), then cuBLAS adds the product to it; without the fusion the bias is one elementwise Add
DISABLED_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"  # a session config entry, names joined by ;
# onnxruntime's exact u8s8 products on x86 without VNNI: int8 weights past ±64 (8-bit ones) are widened so that pairs
# of products cannot saturate 16 bits (7-bit weights are left as they are, at full speed)
EXACT_INT8_KEY = "session.x64quantprecision"
# onnxruntime's pool threads stop spin-waiting as soon as a run returns (and spin again in the next): the served
# post-processing after it gets the cores. Mask2Former semantic int8 at 640², 2 threads, AMD EPYC AVX2: its
# post-processing right after the graph 89 -> 69 ms, the graph 587 -> 580 ms (12 interleaved rounds)
SPINNING_STOP_KEY = "session.force_spinning_stop"
CUDA_DISABLED_OPTIMIZERS = ("MatMulAddFusion",)
# The CPU's own sessions: that Gemm and onnxruntime's SkipLayerNormalization (Add + LayerNormalization) measured
# slower than the nodes they replace on the CPU, in torch.export's graphs (2D linears, where TorchScript's are 3D and
# meet neither): R-50 TESTR 640², fused, 2 threads, Intel Xeon AVX-512/AMX: 1238 -> 1176 ms (TorchScript's graph
# 1147 -> 1149); gather 1941 -> 1902 ms (1836 -> 1845)
CPU_DISABLED_OPTIMIZERS = ("MatMulAddFusion", "SkipLayerNormFusion")


def cuda_options(precision: str = "float32", tf32: bool = False) -> dict[str, str]:
    """The CUDA provider's options d2export serves a graph of `precision` with (the manifest's: float32, float16,
    int8). `use_tf32`: a float32 graph is served in float32, as verified (TF32's 10 mantissa bits swap a two-stage
    model's near-tied proposals: measured on R-50 TESTR, whole detections 624 px apart) unless `tf32`; a float16
    graph gets it on, because onnxruntime's cuDNN-9 convolutions leave out the tensor-core engines whenever it is off,
    float16 ones included (TF32 touches only float32 arithmetic: the nodes a float16 graph keeps in float32, Softmax
    and MSDA's sampling, have float16's 10 mantissa bits anyway). `fuse_conv_bias`: cuDNN adds a convolution's bias in
    the same kernel instead of a second one. `prefer_nhwc`: channels-last convolutions, the tensor cores' layout, where
    they run (float16, or TF32). Proposed from onnxruntime's source; their GPU figures are `tools/benchmark.py gpu`'s
    rows (docs/gpu.md)."""
    tensor_cores = tf32 or precision == "float16"
    on = "1" if tensor_cores else "0"
    return {"use_tf32": on, "fuse_conv_bias": "1", "prefer_nhwc": on}


def options_per_provider(providers: Sequence[str], tf32: bool = False, given: Sequence[dict] | None = None,
                         precision: str = "float32") -> list[dict]:
    """Each provider's options: `given` (one dict per provider, in order) over d2export's defaults (on CUDA
    `cuda_options(precision, tf32)`), so the provider serves what verification compared."""
    given = list(given or [])
    given += [{}] * (len(providers) - len(given))
    return [(cuda_options(precision, tf32) if p == PROVIDERS["cuda"] else {}) | dict(g)
            for p, g in zip(providers, given)]


def serving_settings(options, providers: Sequence[str], precision: str = "float32", tf32: bool = False,
                     given: Sequence[dict] | None = None) -> list[dict]:
    """What a session of `providers` serving a graph of `precision` gets, for the Predictor and for verification
    alike: `options` (onnxruntime SessionOptions) with `CUDA_DISABLED_OPTIMIZERS` turned off where CUDA serves,
    `CPU_DISABLED_OPTIMIZERS` where the CPU alone does, its threads' spin-waiting stopped when a run returns
    (`SPINNING_STOP_KEY`), and an int8 graph's products exact on a CPU without VNNI (`EXACT_INT8_KEY`); returns each
    provider's options (`options_per_provider`)."""
    off = CUDA_DISABLED_OPTIMIZERS if PROVIDERS["cuda"] in providers else CPU_DISABLED_OPTIMIZERS
    options.add_session_config_entry(DISABLED_OPTIMIZERS_KEY, ";".join(off))
    if not config_entry(options, SPINNING_STOP_KEY):  # unless the caller chose
        options.add_session_config_entry(SPINNING_STOP_KEY, "1")
    if precision == "int8" and PROVIDERS["cpu"] in providers and cpu.int8_pairs_saturate():
        options.add_session_config_entry(EXACT_INT8_KEY, "1")  # a graph quantised for a VNNI CPU serves as there
    return options_per_provider(providers, tf32, given, precision)


def config_entry(options, key: str) -> str:
    """A session config entry of onnxruntime SessionOptions ("" if never set)."""
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # onnxruntime's answer for an entry never set
        return ""


def _entry(session, key: str) -> str:
    """A session config entry of an onnxruntime session ("" for OpenVINO's sessions)."""
    return config_entry(session.get_session_options(), key) if hasattr(session, "get_session_options") else ""


def disabled_optimizers(session) -> list[str]:
    """The graph transformers a session was built without (for metadata and the manifest)."""
    return [name for name in _entry(session, DISABLED_OPTIMIZERS_KEY).split(";") if name]


def exact_int8(session) -> bool:
    """Whether a session computes int8 products exactly where the CPU would saturate them (EXACT_INT8_KEY): what a
    server of the same graph on such a CPU must ask onnxruntime for."""
    return _entry(session, EXACT_INT8_KEY) == "1"
