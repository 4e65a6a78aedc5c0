"""d2export's fused MSDA operator, as torch.export records it, translated for torch.onnx's dynamo exporter into the
one d2export-domain node the TorchScript route writes (its schema declared to onnx)."""
from __future__ import annotations

from typing import Sequence

import onnx
import torch


def translations() -> dict:
    """d2export's own ops as torch.export records them -> their ONNX nodes: the fused MSDA as the one node of
    d2export's domain the TorchScript route writes (float32 and int64 operands, the types its kernel declares)."""
    import onnxscript
    from onnxscript import opset18 as op

    import d2export.ops.msda  # noqa: F401  (registers torch.ops.d2export.fused_msda)
    from d2export.kernels.custom_ops import DOMAIN, FUSED_MSDA, FUSED_MSDA_INPUTS

    _declare(DOMAIN, FUSED_MSDA, FUSED_MSDA_INPUTS, ("float", "int64", "int64", "float", "float"))
    ours = onnxscript.values.Opset(DOMAIN, 1)
    float32, int64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64

    def fused(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return getattr(ours, FUSED_MSDA)(op.Cast(value, to=float32), op.Cast(spatial_shapes, to=int64),
                                         op.Cast(level_start_index, to=int64), op.Cast(sampling_locations, to=float32),
                                         op.Cast(attention_weights, to=float32))

    return {torch.ops.d2export.fused_msda.default: fused}


def _declare(domain: str, name: str, inputs: Sequence[str], types: Sequence[str]) -> None:
    """Our node's schema for onnx (once per process): asked for an opset above 18, the exporter converts its
    opset-18 graph, and onnx's version converter refuses a node it knows no schema of."""
    try:
        from onnx.defs import OpSchema, has, register_schema
    except ImportError:  # onnx < 1.16 registers none: the graph stays at the exporter's opset
        return
    if has(name, domain):
        return
    param = OpSchema.FormalParameter
    register_schema(OpSchema(name, domain, 1, inputs=[param(n, f"tensor({t})") for n, t in zip(inputs, types)],
                             outputs=[param("out", "tensor(float)")]))
