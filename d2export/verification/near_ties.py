"""Why a verified-looking graph can still disagree: selections among near-tied candidates.

Two-stage DETRs pick their queries with a TopK over proposal scores. Where candidates at the selection boundary, or
neighbours inside the selection, differ by less than the float noise between onnxruntime and PyTorch, either side may
pick or order them differently. Where query content follows the slot (DINO pairs the i-th proposal with the i-th
learnt embedding), whole detections then change although the graph computes the same function. Random weights make
such ties common; trained ones rarely. On a failed verification, `describe` looks at every TopK of the graph on the
failing cases and says, with figures, where this is happening, so the user is not left hunting a bug that is not
there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

# relative gap under which two scores count as near-tied after a deep network's noise: float32, float16 (whose
# own spacing is ~1e-3 relative), int8 (a step of 1/255 of a tensor's range, ~1e-2 of its largest values) and
# bfloat16 (8 bits of mantissa: a spacing of ~8e-3 relative)
CLOSE = {"float32": 1e-5, "float16": 2e-3, "int8": 1e-2, "bfloat16": 1e-2}


@dataclass
class Selection:
    node: str
    case: str
    k: int
    candidates: int
    boundary_gap: float  # k-th best minus (k+1)-th best candidate (inf where all are selected)
    inner_gap: float  # smallest gap between neighbours inside the selection
    inner_close: int  # neighbours inside the selection closer than close × scale
    scale: float  # mean magnitude of the selected values
    close: float  # the relative gap that counts as a near-tie

    @property
    def near_tied(self) -> bool:
        return min(self.boundary_gap, self.inner_gap) < threshold(self.close, self.scale)

    def line(self) -> str:
        boundary = "" if self.k >= self.candidates else f"boundary gap {self.boundary_gap:.2g}, "
        return (f"{self.case}: TopK {self.node} (k={self.k} of {self.candidates}, values ~{self.scale:.3g}): "
                f"{boundary}smallest gap inside {self.inner_gap:.2g}, {self.inner_close} neighbours within "
                f"{self.close:g} relative")


def attribute(node, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def selecting_session(model_path: str | Path, session_options=None, providers=("CPUExecutionProvider",)):
    """A verification copy of the graph whose outputs also carry every top-level TopK's candidates, values and
    indices (ArgMax's: candidates and indices), every NonMaxSuppression's boxes, scores and selection, also from
    inside an If's branch, where torchvision's batched NMS puts it, and every top-level comparison of a float tensor with a constant (a hard
    threshold inside the network: Mask2Former's attention masks) with its result (the written model is not touched):
    (onnxruntime session, the selecting nodes in graph order; an NMS as an `Exposed` whose names are the graph
    outputs carrying its tensors, a threshold as a `Threshold`)."""
    import onnxruntime as ort

    model, nodes = selecting_model(model_path)
    options = session_options or ort.SessionOptions()
    options.log_severity_level = 3  # the warnings were shown when the graph itself was checked
    session = ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))
    return session, nodes


def selecting_model(model_path: str | Path) -> tuple:
    """The verification copy `selecting_session` opens, as an onnx ModelProto: (the model, the selecting nodes)."""
    import onnx

    model = onnx.load(str(model_path))
    nodes = [n for n in model.graph.node if n.op_type in ("TopK", "ArgMax")]
    typed = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    known = {o.name for o in model.graph.output}
    wanted = {node.input[0]: onnx.TensorProto.FLOAT for node in nodes}
    for node in nodes:  # TopK: values and indices; ArgMax: indices
        types = (onnx.TensorProto.INT64,) if node.op_type == "ArgMax" else (onnx.TensorProto.FLOAT,
                                                                              onnx.TensorProto.INT64)
        wanted |= dict(zip(node.output, types))
    for name, dtype in wanted.items():
        if name not in known:
            model.graph.output.append(typed.get(name) or onnx.helper.make_tensor_value_info(name, dtype, None))
    suppressions = _expose_suppressions(model.graph)
    thresholds = _expose_thresholds(model.graph)
    return model, nodes + suppressions + thresholds


@dataclass
class Exposed:
    """A node's tensors made graph outputs: `input` and `output` name those outputs."""

    op_type: str
    name: str
    input: list
    output: list


_NMS_TENSORS = ((0, "boxes", (1, 0, 4)), (1, "scores", (1, 1, 0)), (None, "selected", (0, 3)))  # (input, name, empty)


def _expose_suppressions(graph) -> list[Exposed]:
    """Each NonMaxSuppression of the top level or of a top-level If's branch: its boxes, scores and selected indices
    become graph outputs. From a branch they pass out through new outputs of the If; the other branch returns empty
    tensors of the same types in their place."""
    from onnx import TensorProto, helper, numpy_helper

    found = []
    for node in [n for n in graph.node if n.op_type in ("NonMaxSuppression", "If")]:
        branches = {a.name: a.g for a in node.attribute if a.type == a.GRAPH}
        for key, branch in branches.items() or [(None, None)]:
            for nms in ([node] if branch is None else [n for n in branch.node if n.op_type == "NonMaxSuppression"]):
                exposed = Exposed("NonMaxSuppression", nms.name or nms.output[0], [], [])
                for slot, label, empty in _NMS_TENSORS:
                    inner = nms.input[slot] if slot is not None else nms.output[0]
                    dtype = TensorProto.INT64 if slot is None else TensorProto.FLOAT
                    outer = inner if branch is None else f"{exposed.name}__{label}"
                    if branch is not None:
                        branch.output.append(helper.make_tensor_value_info(inner, dtype, None))
                        for other in (g for k, g in branches.items() if k != key):
                            blank = f"{outer}__none"
                            value = numpy_helper.from_array(np.zeros(empty, helper.tensor_dtype_to_np_dtype(dtype)))
                            other.node.append(helper.make_node("Constant", [], [blank], value=value))
                            other.output.append(helper.make_tensor_value_info(blank, dtype, None))
                        node.output.append(outer)
                    if outer not in {o.name for o in graph.output}:
                        graph.output.append(helper.make_tensor_value_info(outer, dtype, None))
                    (exposed.output if slot is None else exposed.input).append(outer)
                found.append(exposed)
    return found


@dataclass
class Threshold:
    """A comparison `values <op> threshold` in the graph ("lt", "le", "gt", "ge"), its tensors made graph outputs."""

    op_type: str
    name: str
    input: list  # [the compared values]
    output: list  # [the boolean result]
    op: str
    threshold: float


# ONNX comparison → (its op, the op that holds with its operands swapped: c < x is x > c)
_COMPARISONS = {"Less": ("lt", "gt"), "LessOrEqual": ("le", "ge"), "Greater": ("gt", "lt"),
                "GreaterOrEqual": ("ge", "le")}


def _expose_thresholds(graph) -> list[Threshold]:
    """Each top-level comparison between a float tensor and a one-element constant: the tensor and the result become
    graph outputs."""
    from onnx import TensorProto, helper, numpy_helper

    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.data_type == TensorProto.FLOAT}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
                      and n.attribute[0].t.data_type == TensorProto.FLOAT})
    known = {o.name for o in graph.output}
    found = []
    for node in graph.node:
        if node.op_type not in _COMPARISONS:
            continue
        side = next((i for i, name in enumerate(node.input) if name in constants and constants[name].size == 1), None)
        if side is None or node.input[1 - side] in constants:
            continue
        values = node.input[1 - side]
        for name, dtype in ((values, TensorProto.FLOAT), (node.output[0], TensorProto.BOOL)):
            if name not in known:
                graph.output.append(helper.make_tensor_value_info(name, dtype, None))
                known.add(name)
        found.append(Threshold(node.op_type, node.name or node.output[0], [values], [node.output[0]],
                               _COMPARISONS[node.op_type][side == 0], float(constants[node.input[side]].reshape(()))))
    return found


class SelectingCopy:
    """The graph at `path` as `selecting_session` opens it, opened on first use and then kept: a failed verification's
    pinning and its near-tie lines read the same copy (each opening loads the graph, infers its shapes and starts a
    session)."""

    def __init__(self, path: str | Path, make_options: Callable[[], object] | None = None,
                 open_model: Callable[[object], object] | None = None):
        """`open_model`: a session of another runtime for the copy's ModelProto (OpenVINO's for bfloat16), instead of
        onnxruntime's on `make_options`."""
        self.path, self.make_options = path, make_options  # options made at opening too: a passing check opens none
        self.open_model = open_model

    @functools.cached_property
    def opened(self) -> tuple:
        """(session, the selecting nodes), as `selecting_session` returns them."""
        if self.open_model is not None:
            model, nodes = selecting_model(self.path)
            return self.open_model(model), nodes
        return selecting_session(self.path, self.make_options() if self.make_options else None)


def selections(copy: SelectingCopy, cases, precision: str = "float32") -> list[Selection]:
    """Every TopK of the graph's top level, on every case: the gaps around and inside what it selected (per batch row
    and selection, the worst)."""
    session, nodes = copy.opened
    nodes = [n for n in nodes if n.op_type == "TopK"]
    if not nodes:
        return []
    names = [o.name for o in session.get_outputs()]
    found = []
    for case in cases:
        values = dict(zip(names, session.run(None, case.inputs)))
        for node in nodes:
            axis = attribute(node, "axis", -1)
            k = int(values[node.output[0]].shape[axis])
            candidates = np.moveaxis(np.asarray(values[node.input[0]], dtype=np.float64), axis, -1)
            found.append(_gaps(node.name or node.output[0], case.name, candidates, k, attribute(node, "largest", 1),
                               CLOSE[precision]))
    return found


def _gaps(node: str, case: str, candidates: np.ndarray, k: int, largest: int, close: float) -> Selection:
    rows = candidates.reshape(-1, candidates.shape[-1])
    n = rows.shape[-1]
    ordered = -np.sort(-rows, axis=-1) if largest else np.sort(rows, axis=-1)
    chosen = ordered[:, :k]
    inner = np.abs(np.diff(chosen, axis=-1))
    scale = float(np.abs(chosen).mean()) if chosen.size else 0.0
    boundary = float(np.abs(ordered[:, k - 1] - ordered[:, k]).min()) if 0 < k < n else float("inf")
    return Selection(node, case, k, n, boundary, float(inner.min()) if inner.size else float("inf"),
                     int((inner < threshold(close, scale)).sum()), scale, close)


def threshold(close: float, scale: float) -> float:
    """The absolute gap that counts as a near-tie: relative to the values' size, absolute below 1."""
    return close * max(scale, 1.0)


def describe(copy: SelectingCopy, cases: Sequence, precision: str = "float32") -> str:
    """Lines for a verification error: the near-tied selections on `cases`, or '' where there are none."""
    try:
        tied = [s for s in selections(copy, cases, precision) if s.near_tied]
    except Exception as e:  # noqa: BLE001 - a diagnosis must never hide the error it explains
        return f"(selections not checked: {type(e).__name__}: {e})"
    if not tied:
        return ""
    return ("near-tied selections in the graph: float noise between onnxruntime and PyTorch can pick or order these "
            "candidates differently, which changes whole detections without a wrong graph (common with random "
            "weights; check with trained ones):\n" + "\n".join("  " + s.line() for s in tied))
