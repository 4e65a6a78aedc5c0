"""An ONNX graph served by OpenVINO on the CPU, in float32 or bfloat16, behind the face of an onnxruntime session
(`get_inputs`/`get_outputs` with name, shape and type; `run(output_names, feeds)` → numpy arrays): what serves an
`export.bf16` graph (onnxruntime's CPU provider has no bfloat16 GEMM; OpenVINO's `INFERENCE_PRECISION_HINT=bf16`
computes matrix products and convolutions in bfloat16 where the CPU has AVX512-BF16 or AMX-BF16), and an int8 graph
with export.runtime=openvino (at "f32", OpenVINO runs a QDQ graph's quantised products in int8, on VNNI or AMX-INT8,
and the rest in float32). Torch-free."""
from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from d2export import cpu
from d2export.kernels import openvino_extension
from d2export.kernels.custom_ops import FUSED_MSDA_ID, file_ops
from d2export.runtime.model_loading import ORT_TYPE_NAMES
from d2export.runtime.providers import ProviderUnavailable

BF16_FEATURES = ("avx512_bf16", "amx_bf16")  # d2export.cpu's names of the instructions OpenVINO's bf16 kernels use
# ours or OpenVINO's → OpenVINO's hint; an int8 graph's quantised products run in int8 at "f32", the rest in float32
PRECISIONS = {"float32": "f32", "f32": "f32", "int8": "f32", "bfloat16": "bf16", "bf16": "bf16"}
PROVIDER = "OpenVINO CPU"  # what `get_providers` answers: the Predictor's metadata and verification's record
INSTALL = "pip install 'd2export[openvino]'"


class Bf16Unavailable(ProviderUnavailable):
    """bfloat16 asked for where it cannot be served: this CPU has no bfloat16 instructions."""


def bf16_supported(features: Iterable[str] | None = None) -> bool:
    """Whether a CPU with `features` (d2export.cpu's names; None: this CPU's) computes bfloat16 natively."""
    return bool(set(cpu.cpu_features() if features is None else features) & set(BF16_FEATURES))


def require_bf16(features: Iterable[str] | None = None, what: str = "a bfloat16 graph",
                 instead: str = "serve it on such a CPU, or export float32 (leave export.bf16 off) for this one") -> None:
    """Bf16Unavailable, in one line saying what to do `instead`, on a CPU without AVX512-BF16 or AMX-BF16."""
    if not bf16_supported(features):
        has = " ".join(cpu.cpu_features() if features is None else features) or "none of d2export.cpu.FEATURES"
        raise Bf16Unavailable(f"{what} needs a CPU with AVX512-BF16 or AMX-BF16 (this one has {has}): {instead}")


def require_exact_int8(path: Path, features: Iterable[str] | None = None) -> None:
    """ProviderUnavailable, in one line, for an int8 graph with 8-bit weights (quantised for a CPU with VNNI or AMX)
    on an x86 CPU without an int8 dot product: OpenVINO's products of such weights saturate there (onnxruntime's
    are made exact, providers.EXACT_INT8_KEY). Weights within ±64 (7 bits) cannot saturate."""
    if not cpu.int8_pairs_saturate(None if features is None else list(features)):
        return
    import numpy as np
    import onnx
    from onnx import numpy_helper

    weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
               if t.data_type == onnx.TensorProto.INT8]
    if any(np.abs(w.astype(np.int16)).max(initial=0) > 64 for w in weights):
        has = " ".join(cpu.cpu_features() if features is None else features) or "none of d2export.cpu.FEATURES"
        raise ProviderUnavailable(f"{path.name}: its int8 weights use 8 bits, and OpenVINO's products of them would "
                                  f"saturate on this CPU (no VNNI or AMX; it has {has}): serve it through onnxruntime "
                                  "(export.runtime=onnxruntime), which computes them exactly, or export it with "
                                  "export.int8_weight_bits=7")


@dataclass(frozen=True)
class Arg:
    """An input or output as onnxruntime's NodeArg shows it: name, shape (ints, strings for dynamic axes), type
    ("tensor(float)")."""

    name: str
    shape: list
    type: str


def _type_name(element_type) -> str:
    import numpy as np

    name = np.dtype(element_type.to_dtype()).name
    return f"tensor({ORT_TYPE_NAMES.get(name, name)})"


def _onnx_names(path: Path) -> tuple[set, set]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    return {i.name for i in graph.input if i.name not in initializers}, {o.name for o in graph.output}


class OpenVINOSession:
    """The graph at `path` compiled by OpenVINO for the CPU at `precision` ("f32"/"float32" or "bf16"/"bfloat16")
    on `threads` threads (0: OpenVINO's choice, one per core). `run` is safe to call from several threads (an
    inference request each)."""

    def __init__(self, path: str | os.PathLike, precision: str = "f32", threads: int = 0):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose f32 or bf16")
        self.path, self.precision, self.threads = Path(path), PRECISIONS[precision], int(threads)
        if self.precision == "bf16":
            require_bf16(what="OpenVINO in bfloat16")
        if precision == "int8":
            require_exact_int8(self.path)
        try:
            import openvino as ov
        except ImportError as e:
            raise ProviderUnavailable(f"serving through OpenVINO needs the openvino package ({e}): {INSTALL}") from None
        self.version = ov.__version__
        core = ov.Core()
        if FUSED_MSDA_ID in file_ops(self.path):  # export.sampler=fused: d2export's operator, as an OpenVINO extension
            core.add_extension(openvino_extension.library())
        model = core.read_model(str(self.path))
        config = {"INFERENCE_PRECISION_HINT": self.precision, "PERFORMANCE_HINT": "LATENCY"}
        if self.threads > 0:
            config["INFERENCE_NUM_THREADS"] = self.threads
        self.compiled = core.compile_model(model, "CPU", config)
        inputs, outputs = _onnx_names(self.path)
        self._inputs = [self._arg(p, inputs) for p in self.compiled.inputs]
        self._outputs = [self._arg(p, outputs) for p in self.compiled.outputs]
        self._index = {a.name: i for i, a in enumerate(self._outputs)}
        self._local = threading.local()

    @staticmethod
    def _arg(port, onnx_names: set) -> Arg:
        names = port.get_names()
        name = next((n for n in sorted(names) if n in onnx_names), port.any_name)
        shape = [d.get_length() if d.is_static else f"dim{i}" for i, d in enumerate(port.get_partial_shape())]
        return Arg(name, shape, _type_name(port.get_element_type()))

    def get_inputs(self) -> list[Arg]:
        return list(self._inputs)

    def get_outputs(self) -> list[Arg]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, feeds: dict) -> list:
        """The outputs named (None: all, in the graph's order) for `feeds` (input name → numpy array)."""
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        by_port = {i: feeds[a.name] for i, a in enumerate(self._inputs)}
        results = request.infer(by_port, share_inputs=False, share_outputs=False)
        values = results.to_tuple()  # in the compiled model's output order
        names = [a.name for a in self._outputs] if output_names is None else list(output_names)
        return [values[self._index[n]] for n in names]

    # what onnxruntime sessions also answer, for the Predictor's metadata and verification's record
    def get_providers(self) -> list[str]:
        return [PROVIDER]

    def get_provider_options(self) -> dict:
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT")  # what OpenVINO settled on, an ov.Type
        return {PROVIDER: {"INFERENCE_PRECISION_HINT": getattr(hint, "get_type_name", lambda: str(hint))(),
                           "INFERENCE_NUM_THREADS": str(self.compiled.get_property("INFERENCE_NUM_THREADS")),
                           "openvino": self.version}}


def open_model(model, precision: str = "f32", threads: int = 0) -> OpenVINOSession:
    """An `OpenVINOSession` of an in-memory onnx ModelProto (written to a temporary file OpenVINO reads; removed
    once compiled)."""
    with tempfile.TemporaryDirectory(prefix="d2export-ov-") as folder:
        path = Path(folder) / "model.onnx"
        path.write_bytes(model.SerializeToString())
        return OpenVINOSession(path, precision, threads)
