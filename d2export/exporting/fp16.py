"""A float32 ONNX graph → float16 weights and activations, with chosen nodes kept in float32.

For GPU serving: half the weights' size and memory traffic. By default the MSDA sampling cores (pixel coordinates in
float16 are off by up to 1/8 px at 256 px, see `ops.msda`) and every Softmax stay float32. With keep_io_types the
graph's inputs and outputs keep their types, so callers feed and read it exactly like the float32 graph.

The fused MSDA operator (export.sampler=fused) is kept float32 too unless `fused="float16"` (export.fp16_fused): then
its value and output are float16 (read as float16, summed in float32 by the kernel, rounded once) and its sampling
locations and attention weights stay float32 (made by the kept core, so the pixel coordinates keep float32's
precision): the operator's (float16, float32) variant, half the bytes of its largest input and of its output.

How: every float tensor becomes float16 except those made by a kept node; a Cast is put wherever a consumer wants the
other precision. A node with subgraphs (an If, as torchvision's batched NMS exports) is kept whole: its branches stay
as they are, in float32, and the outer tensors they read get a Cast like any kept node's inputs. Constants used only
in float16 are stored in float16, clamped to its range (±65504; magnitudes below its smallest subnormal become that,
not 0); one that a float32 consumer also reads keeps its float32 value (no rounding) and gets a Cast, which
onnxruntime folds when it loads the graph.

Why not onnxruntime's `onnxruntime.transformers.float16.convert_float_to_float16`: measured on the tiny TESTR graph
with the same block list (MSDA cores, Softmax) at four sizes, both agree with the float32 graph equally well once
detections are matched (control points within 0.04–0.07 px, the same top-5); the maintained one converts 3x slower
(32 s against 10 s, machine under load), makes 4574 nodes against 3899 here (a float16 round trip between every two
kept nodes) and writes node order the ONNX checker refuses (its input Casts come last).
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from d2export.config import FUSED_PRECISIONS
from d2export.exporting.graph_scopes import is_msda_core, msda_scopes

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
# inputs that the ONNX spec types as float32 whatever the data's type (Resize's roi and scales)
_FLOAT32_SLOTS = {"Resize": {1, 2}, "Upsample": {1}}
_NO_FLOAT16 = {"Range", "TopK", "CumSum", "NonMaxSuppression", "RoiAlign"}  # float32-only (spec or CPU kernels)
_FLOAT16_MAX, _FLOAT16_TINY = 65504.0, 2.0 ** -24


_FUSED_FLOAT32_SLOTS = {3, 4}  # the fused operator's sampling_locations and attention_weights


def _is_fused(node: onnx.NodeProto) -> bool:
    from d2export.kernels.custom_ops import DOMAIN, FUSED_MSDA

    return node.domain == DOMAIN and node.op_type == FUSED_MSDA


def default_keep(graph: onnx.GraphProto, fused: str = "float32") -> Callable[[onnx.NodeProto], bool]:
    """Softmax and the MSDA sampling cores, the fused operator included (it sits in its module's scope). With
    fused="float16", the fused nodes and the pure data movement around their value and output (a float16 graph's
    value_proj → masked fill → Reshape → fused → Reshape → output_proj) become float16: moving float16 values is
    exact, and no Cast pair is left around the node's largest input and its output."""
    scopes = msda_scopes(graph)
    half = _float16_fused_chains(graph, scopes) if fused == "float16" else set()
    return lambda node: node.op_type == "Softmax" or (is_msda_core(node, scopes) and _key(node) not in half)


_MOVES = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Where"}  # no arithmetic


def _key(node: onnx.NodeProto) -> str:
    return node.output[0] if node.output else node.name


def _float16_fused_chains(graph: onnx.GraphProto, scopes: set[str]) -> set[str]:
    """Keys of the fused nodes and of the core's data-movement nodes that feed a fused node's value alone (walking
    back) or take its output alone (walking forward)."""
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in graph.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))
    constant = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}

    def data_inputs(node: onnx.NodeProto) -> list[int]:
        return [1, 2] if node.op_type == "Where" else [0]

    def movable(node: onnx.NodeProto) -> bool:
        return node.op_type in _MOVES and is_msda_core(node, scopes)

    chains = set()
    for fused in filter(_is_fused, graph.node):
        chains.add(_key(fused))
        tensor = fused.input[0]
        while len(consumers.get(tensor, ())) == 1 and (p := producers.get(tensor)) is not None and movable(p):
            chains.add(_key(p))
            ahead = [p.input[i] for i in data_inputs(p) if i < len(p.input) and p.input[i] not in constant]
            if len(ahead) != 1:
                break
            tensor = ahead[0]
        tensor = fused.output[0]
        while len(users := consumers.get(tensor, ())) == 1 and movable(users[0][0]) and \
                users[0][1] in data_inputs(users[0][0]):
            chains.add(_key(users[0][0]))
            tensor = users[0][0].output[0]
    return chains


def to_float16(model: onnx.ModelProto, keep: Callable[[onnx.NodeProto], bool] | None = None,
               keep_io_types: bool = True, fused: str = "float32") -> onnx.ModelProto:
    """A float16 copy of `model`; nodes for which `keep(node)` is true compute in float32. `keep_io_types`: the
    graph's float inputs and outputs stay float32 (callers feed and read it like the float32 graph); else float16.
    `fused`: the fused MSDA operator's value and output precision under the default `keep` (see the module's doc);
    whatever keeps it, a float16 fused node reads its locations and weights in float32."""
    if fused not in FUSED_PRECISIONS:
        raise ValueError(f"fused={fused!r}: choose one of {', '.join(FUSED_PRECISIONS)}")
    model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph
    keep = keep or default_keep(graph, fused)
    nodes = list(graph.node)  # one wrapper per node: ids stay valid while the list lives
    outer = {id(n): list(_outer_reads(n)) for n in nodes if _subgraphs(n)}  # what each If/Loop/Scan's branches read
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    constants = {t.name: t for t in graph.initializer}
    for node in nodes:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
            types[node.output[0]] = node.attribute[0].t.data_type

    kept = {id(n) for n in nodes if keep(n) or n.op_type in _NO_FLOAT16 or id(n) in outer}
    # the precision each float tensor's consumers want
    wanted: dict[str, set[int]] = {}
    for node in nodes:
        for i, name in enumerate(node.input):
            if name and types.get(name) == FLOAT:
                fp32 = id(node) in kept or _float32_slot(node, i)
                wanted.setdefault(name, set()).add(FLOAT if fp32 else HALF)
        for name, _ in outer.get(id(node), ()):
            if types.get(name) == FLOAT:
                wanted.setdefault(name, set()).add(FLOAT)
    for out in graph.output:
        if types.get(out.name) == FLOAT and keep_io_types:
            wanted.setdefault(out.name, set()).add(FLOAT)

    # the precision each float tensor is made in
    made: dict[str, int] = {v.name: FLOAT if keep_io_types else HALF
                            for v in graph.input if v.type.tensor_type.elem_type == FLOAT}
    if not keep_io_types:
        for v in graph.input:
            if v.type.tensor_type.elem_type == FLOAT:
                v.type.tensor_type.elem_type = HALF
    for name, tensor in constants.items():
        if tensor.data_type == FLOAT:
            made[name] = HALF if wanted.get(name) == {HALF} else FLOAT
    for node in nodes:
        if node.op_type == "Constant" and node.output[0] in constants:
            continue
        for name in node.output:
            if types.get(name) == FLOAT:
                made[name] = FLOAT if id(node) in kept else HALF
        if id(node) not in kept:
            _retype_attributes(node)

    for name, tensor in constants.items():
        if made.get(name) == HALF:
            tensor.CopyFrom(_half(tensor))

    casts, new_nodes = {}, []

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}__as_{'fp32' if to == FLOAT else 'fp16'}"
            new_nodes.append(helper.make_node("Cast", [name], [casts[key]], to=to, name=f"{casts[key]}_cast"))
        return casts[key]

    outputs = {o.name for o in graph.output}
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in made:
                fp32 = id(node) in kept or _float32_slot(node, i)
                if made[name] != (FLOAT if fp32 else HALF):
                    node.input[i] = cast(name, FLOAT if fp32 else HALF)
        for name, point_to in outer.get(id(node), ()):
            if made.get(name) == HALF:
                point_to(cast(name, FLOAT))
        new_nodes.append(node)
        for i, name in enumerate(node.output):
            if name in outputs and made.get(name) == HALF and keep_io_types:  # the graph's outputs keep float32
                node.output[i] = f"{name}__fp16"
                new_nodes.append(helper.make_node("Cast", [node.output[i]], [name], to=FLOAT, name=f"{name}_cast"))
    del graph.node[:]
    graph.node.extend(new_nodes)
    if not keep_io_types:  # outputs made in float16 are declared so (those of kept nodes stay float32)
        for out in graph.output:
            if made.get(out.name) == HALF:
                out.type.tensor_type.elem_type = HALF
    # stale element types: onnxruntime infers them again, except the sizes of what custom operators make (it cannot:
    # without them a fixed-size graph's shapes after the fused MSDA stay unknown and unfolded), their types updated
    custom = {o for n in graph.node if n.domain not in ("", "ai.onnx") for o in n.output}
    known = [v for v in graph.value_info if v.name in custom]
    del graph.value_info[:]
    for v in known:
        v.type.tensor_type.elem_type = made.get(v.name, v.type.tensor_type.elem_type)
    graph.value_info.extend(known)
    return model


def _float32_slot(node: onnx.NodeProto, i: int) -> bool:
    """Input `i` of a float16 `node` that stays float32: Resize's roi and scales (the spec's), a fused MSDA node's
    locations and weights (the operator's float16-value variant takes them in float32)."""
    if _is_fused(node):
        return i in _FUSED_FLOAT32_SLOTS
    return node.domain in ("", "ai.onnx") and i in _FLOAT32_SLOTS.get(node.op_type, ())


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH] + \
        [g for a in node.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs]


def _defined(g: onnx.GraphProto, local: frozenset) -> frozenset:
    """Names visible inside subgraph `g`'s own scope (its inputs, initializers, nodes' outputs) or an enclosing one."""
    return local | {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}


def _outer_reads(node: onnx.NodeProto, local: frozenset = frozenset()) -> Iterator[tuple[str, Callable[[str], None]]]:
    """Each read, in `node`'s subgraphs at any depth, of a name from the scopes around them: (the name, a setter that
    points that read elsewhere)."""
    for g in _subgraphs(node):
        inner = _defined(g, local)
        for n in g.node:
            for i, name in enumerate(n.input):
                if name and name not in inner:
                    yield name, functools.partial(n.input.__setitem__, i)
            yield from _outer_reads(n, inner)
        for o in g.output:
            if o.name not in inner:  # a branch that returns an outer tensor as it is
                yield o.name, functools.partial(setattr, o, "name")


def _half(tensor: TensorProto) -> TensorProto:
    """float32 → float16, clamped to float16's range instead of overflowing to ±inf or underflowing to 0."""
    data = numpy_helper.to_array(tensor).astype(np.float32)
    finite = np.isfinite(data)
    clamped = np.where(finite, np.clip(data, -_FLOAT16_MAX, _FLOAT16_MAX), data)
    tiny = finite & (clamped != 0) & (np.abs(clamped) < _FLOAT16_TINY)
    clamped = np.where(tiny, np.sign(clamped) * _FLOAT16_TINY, clamped)
    return numpy_helper.from_array(clamped.astype(np.float16), tensor.name)


def _retype_attributes(node: onnx.NodeProto) -> None:
    """Attributes that fix an output's type to float32 in a node that now makes float16."""
    for attr in node.attribute:
        if node.op_type == "Cast" and attr.name == "to" and attr.i == FLOAT:
            attr.i = HALF
        elif node.op_type == "ConstantOfShape" and attr.name == "value" and attr.t.data_type == FLOAT:
            attr.t.CopyFrom(_half(attr.t))
