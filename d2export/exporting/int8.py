"""int8 graphs with onnxruntime's quantization tooling (chosen over our own: its QDQ and integer kernels are what
onnxruntime runs fast). `quant_pre_process` first (shape inference and the basic optimisations the tooling expects),
then dynamic (weights int8, activations quantised per run) or static (activations' ranges calibrated on pictures)
quantisation of the operator types that pay, with what int8 breaks kept float by the family's `int8_float_scopes`.
"""
from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from d2export.cpu import INT8_DOT_PRODUCT

log = logging.getLogger("d2export")

MODES = ("dynamic", "static")
METHODS = ("minmax", "entropy", "percentile")
ROUNDINGS = ("nearest", "gptq")
# Conv through ConvInteger (dynamic) is slower than float on onnxruntime's CPU provider: dynamic takes the MatMuls;
# static takes what the family's `int8_static_ops` says
DYNAMIC_OPS = ("MatMul", "Gemm")


@dataclass
class Int8Record:
    """What was quantised and how: the manifest's `verification["int8"]["quantization"]`."""

    mode: str
    op_types: list
    reduce_range: bool
    why_reduce_range: str
    kept_float: list  # node names of the quantised op types left float
    quantized: int  # nodes of those types quantised
    calibration: dict | None = None
    rounding: str = "nearest"  # of the weights: nearest, or gptq (weight_rounding.py)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def reduce_range_for(features: Sequence[str], bits: int = 0) -> tuple[bool, str]:
    """7-bit weights where the CPU lacks VNNI: u8s8 products summed in pairs saturate int16 on AVX2/AVX-512 alone;
    `bits` 7 or 8 (export.int8_weight_bits) chooses for the CPUs that will serve the graph instead."""
    if bits:
        served = ("a CPU without VNNI serves 8-bit weights through onnxruntime's exact (slower) products"
                  if bits == 8 else "7-bit weights serve at full speed on any CPU")
        return bits == 7, f"export.int8_weight_bits={bits}: {served}"
    have = [f for f in INT8_DOT_PRODUCT if f in features]
    if have:
        return False, f"the CPU has {', '.join(have)}: full 8-bit range"
    return True, "no VNNI on this CPU: 7-bit weights (reduce_range) avoid u8s8 saturation"


def in_scope(node_name: str, scopes: Sequence[str]) -> bool:
    """Whether a node named by torch.onnx after its module path ("/testr/ctrl_point_coord.0/layers.1/MatMul") lies in
    a module named in `scopes` ("ctrl_point_coord" takes its list items ctrl_point_coord.0, .1, … too, and the
    module's later calls, which torch.onnx names with a suffix: text_class_1 is the character classifier run on the
    last decoder layer's output, the one the graph returns)."""
    parts = node_name.split("/")
    return any(re.fullmatch(rf"{re.escape(s)}(_\d+)?(\..*)?", p) for p in parts for s in scopes)


def unmatched(model, op_types: Sequence[str], scopes: Sequence[str]) -> list[str]:
    """The scopes that hold no node of `op_types`: a misspelt name would otherwise keep nothing float, silently."""
    names = [n.name for n in model.graph.node if n.op_type in op_types]
    return [s for s in scopes if not any(in_scope(name, (s,)) for name in names)]


def float_nodes(model, op_types: Sequence[str], scopes: Sequence[str]) -> list[str]:
    """The nodes of `op_types` in `scopes`."""
    return [n.name for n in model.graph.node if n.op_type in op_types and in_scope(n.name, scopes)]


def activation_matmuls(model) -> list[str]:
    """MatMuls whose second operand is not a weight (attention's query-by-key and weights-by-value products).
    onnxruntime's QDQ quantiser ignores `MatMulConstBOnly` (only its QOperator and dynamic paths read it): static int8
    named these here, or it quantised them and the softmax between them with them (60 products and 24 softmaxes of
    the R-50 spotter's decoder)."""
    constant = {t.name for t in model.graph.initializer}
    constant |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] not in constant]


def own_weights(model) -> int:
    """Gives each node reading a quantised weight its own copy (a module called twice shares its weight: the
    character head on two decoder layers). onnxruntime's exact products on CPUs without VNNI convert each int8 weight
    to uint8 per reading node, and fail a session whose weight two nodes read ("Attempt to replace the existing
    tensor"). Returns the copies made; the graph computes the same."""
    import copy

    from onnx import TensorProto, helper

    graph = model.graph
    stored = {t.name: t for t in graph.initializer}

    def readers() -> dict[str, list[tuple]]:
        found: dict[str, list[tuple]] = {}
        for n in graph.node:
            for k, i in enumerate(n.input):
                found.setdefault(i, []).append((n, k))
        return found

    def copied(name: str, tag: str) -> str:
        t = copy.deepcopy(stored[name])
        t.name = f"{name}_{tag}"
        graph.initializer.append(t)
        return t.name

    made, first, reading = 0, [], readers()
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in stored
               and stored[n.input[0]].data_type == TensorProto.INT8]:
        for j, (node, k) in enumerate(reading.get(dq.output[0], [])[1:], 1):
            clone = helper.make_node("DequantizeLinear", [copied(i, f"own{j}") if i in stored else i for i in dq.input],
                                     [f"{dq.output[0]}_own{j}"], name=f"{dq.name}_own{j}")
            clone.attribute.extend(dq.attribute)
            first.append(clone)
            node.input[k] = clone.output[0]
            made += 1
    reading = readers()
    for t in [t for t in list(graph.initializer) if t.data_type == TensorProto.INT8]:
        for j, (node, k) in enumerate(reading.get(t.name, [])[1:], 1):
            node.input[k] = copied(t.name, f"own{j}")
            made += 1
    for clone in reversed(first):  # initializers only in: ahead of everything
        graph.node.insert(0, clone)
    return made


INTEGER_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "ConvInteger", "QLinearConv", "QLinearMatMul")


def quantized_count(model) -> int:
    """Operators that compute in int8: integer ones (dynamic), or float ones fed a dequantised weight (QDQ; an
    activation that passed through QuantizeLinear is not a weight)."""
    weights = {t.name for t in model.graph.initializer}
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights
                   for o in n.output}
    return sum(n.op_type in INTEGER_OPS or (n.op_type in ("Conv", "MatMul", "Gemm") and len(n.input) > 1
                                            and n.input[1] in dequantized) for n in model.graph.node)


class Pictures:
    """onnxruntime's CalibrationDataReader over picture files, one picture a run, resized and fed as the graph takes
    them (`feeds(chw) -> dict`); `set_range` lets the calibrator take them a few at a time (bounded memory)."""

    def __init__(self, files: Sequence[Path], feeds: Callable[[np.ndarray], dict]):
        self.files, self.feeds = list(files), feeds
        self.start, self.end, self.at = 0, len(self.files), 0

    def __len__(self) -> int:
        return len(self.files)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end, self.at = start_index, min(end_index, len(self.files)), start_index

    def get_next(self) -> dict | None:
        if self.at >= self.end:
            return None
        from PIL import Image

        with Image.open(self.files[self.at]) as im:
            picture = np.asarray(im.convert("RGB"))
        self.at += 1
        return self.feeds(picture)


def basic_optimised(src: Path, dst: Path, ops: Sequence[str]) -> None:
    """onnxruntime's basic graph optimisations (BatchNormalization folded into its Conv, constants folded) written to
    `dst`, as `quant_pre_process` runs them but with the graph's custom operators registered: its own session cannot
    load them, and without the folding every convolution of the fused graph stayed float, its int8 weights
    dequantised at each run (onnxruntime fuses a quantised Conv only where a quantised output follows it)."""
    import onnxruntime

    from d2export.kernels import custom_ops

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    onnxruntime.InferenceSession(str(src), custom_ops.register(options, ops), providers=["CPUExecutionProvider"])


@contextlib.contextmanager
def calibrator_running(ops: Sequence[str]) -> Iterator[None]:
    """onnxruntime's calibrators open their session with bare options, which cannot load d2export's fused operator:
    for the block, they open it with the operator registered (the kernel the runtime serves with), so the fused
    graph is calibrated as it is served. Nothing changes for a graph without custom operators."""
    if not ops:
        yield
        return
    import onnxruntime
    from onnxruntime.quantization.calibrate import CalibraterBase

    from d2export.kernels import custom_ops

    def create_inference_session(self):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL  # as onnxruntime's
        self.infer_session = onnxruntime.InferenceSession(self.augmented_model_path,
                                                          sess_options=custom_ops.register(options, ops),
                                                          providers=self.execution_providers)

    own = CalibraterBase.__dict__["create_inference_session"]
    CalibraterBase.create_inference_session = create_inference_session
    try:
        yield
    finally:
        CalibraterBase.create_inference_session = own


def quantize(src: Path, dst: Path, mode: str, scopes: Sequence[str], features: Sequence[str],
             pictures: Pictures | None = None, method: str = "minmax",
             static_ops: Sequence[str] = ("Conv", "MatMul", "Gemm"), weight_bits: int = 0,
             rounding: str = "nearest") -> Int8Record:
    """The float32 graph at `src` quantised into `dst` (static needs `pictures`; it quantises `static_ops`);
    `rounding` gptq re-rounds the quantised weights against the pictures' activations (weight_rounding.py)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if mode not in MODES:
        raise ValueError(f"export.int8={mode!r}: choose one of {MODES}")
    if rounding not in ROUNDINGS or (rounding == "gptq" and mode != "static"):
        raise ValueError(f"export.int8_rounding={rounding!r}: choose one of {ROUNDINGS} (gptq with static int8)")
    op_types = list(DYNAMIC_OPS if mode == "dynamic" else static_ops)
    reduce_range, why = reduce_range_for(features, weight_bits)
    from d2export.kernels.custom_ops import graph_ops

    custom = graph_ops(onnx.load(str(src), load_external_data=False))
    with tempfile.TemporaryDirectory(prefix="d2export-int8-") as tmp:
        optimised, pre = Path(tmp) / "optimised.onnx", Path(tmp) / "pre.onnx"
        basic_optimised(src, optimised, custom)
        # shapes are dynamic: ONNX's inference alone
        quant_pre_process(str(optimised), str(pre), skip_symbolic_shape=True, skip_optimization=True)
        prepared = onnx.load(str(pre), load_external_data=False)
        kept = float_nodes(prepared, op_types, scopes)
        # weight MatMuls only: attention's activation x activation products stay float
        options = {"MatMulConstBOnly": True}
        if mode == "static":
            kept += [name for name in activation_matmuls(prepared) if name not in kept]
        if mode == "dynamic":
            # the dynamic quantiser turns each Gemm into a MatMul named "<Gemm>_MatMul" (and an Add) after it read
            # nodes_to_exclude: a Gemm kept float is excluded under that name too, or it is quantised all the same
            gemms = {n.name for n in prepared.graph.node if n.op_type == "Gemm"}
            excluded = kept + [f"{name}_MatMul" for name in kept if name in gemms]
            quantize_dynamic(str(pre), str(dst), op_types_to_quantize=op_types, per_channel=False,
                             reduce_range=reduce_range, weight_type=QuantType.QInt8, nodes_to_exclude=excluded,
                             extra_options=options)
            calibration = None
        else:
            if pictures is None:
                raise ValueError("export.int8=static needs calibration pictures (export.calibration.source)")
            methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                       "percentile": CalibrationMethod.Percentile}
            if method not in methods:
                raise ValueError(f"export.calibration.method={method!r}: choose one of {METHODS}")
            # one picture at a time through the calibrator, its ranges or histograms kept, its tensors dropped
            options |= {"CalibStridedMinMax": 1, "ActivationSymmetric": False, "WeightSymmetric": True,
                        # MatMul products leave in float: a quantised output would reach the attention products and
                        # the softmax after them in int8, which onnxruntime then fuses into integer ops (Conv keeps its
                        # quantised output: onnxruntime's integer convolution, QLinearConv, needs it)
                        "OpTypesToExcludeOutputQuantization": ["MatMul"]}
            with calibrator_running(custom):
                quantize_static(str(pre), str(dst), pictures, quant_format=QuantFormat.QDQ,
                                op_types_to_quantize=op_types, per_channel=True, reduce_range=reduce_range,
                                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, nodes_to_exclude=kept,
                                calibrate_method=methods[method], extra_options=options)
            calibration = {"pictures": len(pictures), "method": method}
        written = onnx.load(str(dst))
        if rounding == "gptq":
            from d2export.exporting import weight_rounding

            pictures.set_range(0, len(pictures))
            refined = weight_rounding.refine(written, weight_rounding.float_originals(prepared),
                                             iter(pictures.get_next, None), reduce_range, custom)
            calibration["gptq_weights"] = refined
    if own_weights(written) or rounding == "gptq":
        onnx.save(written, str(dst))
    quantized = quantized_count(written)
    return Int8Record(mode, op_types, reduce_range, why, kept, quantized, calibration, rounding)

