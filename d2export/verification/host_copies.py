"""Where a graph served on a GPU would copy between host and device, found without a GPU.

onnxruntime's CUDA provider runs shape arithmetic (what is computed from `Shape` and `Size` alone) on the CPU. That
costs nothing where the result is a size a kernel reads from host memory (a `Reshape`'s shape, a `Slice`'s starts),
but where it reaches a device kernel's data (a level's size cast to float and multiplied into sampling locations) the
provider inserts a Memcpy node, and a graph with Memcpy nodes cannot be captured as a CUDA graph. This reads the
graph as onnxruntime will run it (after its basic optimizations, which fold every shape a fixed-size graph knows)
and lists those crossings.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx

# Inputs that the CUDA provider's kernels read from host memory (onnxruntime's `InputMemoryType(OrtMemTypeCPUInput)`),
# by input position; d2export's fused MSDA reads its level sizes and starts so too.
HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Unsqueeze": (1,), "Squeeze": (1,), "Split": (1,), "Pad": (1, 2), "Resize": (1, 2, 3), "Upsample": (1,),
    "TopK": (1,), "OneHot": (1,), "NonMaxSuppression": (2, 3, 4),
    **{op: (1,) for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2")},
    "MultiScaleDeformableAttention": (1, 2),
}
SHAPE_SOURCES = ("Shape", "Size")


@dataclass(frozen=True)
class Crossing:
    """A host-computed value read as data by a node that runs on the device."""
    node: str
    op: str
    tensor: str
    made_by: str  # the op type that computed it on the host


def crossings(model: onnx.ModelProto) -> list[Crossing]:
    """The host → device crossings of `model` as given (see `optimized` for the graph onnxruntime runs)."""
    graph = model.graph
    host: dict[str, str] = {}  # tensor → the op that made it on the host
    fixed = {t.name for t in graph.initializer}
    found = []
    for node in graph.node:  # ONNX keeps nodes in topological order
        if node.op_type == "Constant":
            fixed.update(node.output)
            continue
        inputs = [name for name in node.input if name]
        on_host = node.op_type in SHAPE_SOURCES or (
            any(name in host for name in inputs) and all(name in host or name in fixed for name in inputs))
        if on_host:
            host.update({out: node.op_type for out in node.output})
            continue
        read_on_host = HOST_INPUTS.get(node.op_type, ())
        found += [Crossing(node.name, node.op_type, name, host[name])
                  for i, name in enumerate(node.input) if name in host and i not in read_on_host]
    return found


def optimized(path: Path) -> onnx.ModelProto:
    """The graph at `path` after onnxruntime's basic optimizations (constant folding, shapes it knows folded): what
    its providers partition. Computed on the CPU provider, with the custom operators the graph needs."""
    import onnxruntime as ort

    from d2export.verification.check_sessions import session_options

    options = session_options(Path(path))
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    with tempfile.TemporaryDirectory(prefix="d2export_basic_") as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "basic.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return onnx.load(options.optimized_model_filepath, load_external_data=False)


def census(path: Path) -> dict:
    """What the benchmark and a user read: the optimized graph's nodes, its shape nodes and its crossings by kind."""
    model = optimized(path)
    found = crossings(model)
    return {"nodes": len(model.graph.node), "shape_nodes": sum(n.op_type in SHAPE_SOURCES for n in model.graph.node),
            "host_to_device": len(found), "by_kind": dict(Counter(f"{c.made_by} → {c.op}" for c in found))}
