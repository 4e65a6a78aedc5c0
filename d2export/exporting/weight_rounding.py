"""Error-compensating rounding of a QDQ graph's int8 weights (GPTQ, Frantar et al. 2022), scales kept.

Rounding each weight to its nearest step looked like what costs the heads recipe its accuracy: with activations
nearly exact the micro spotter lost as much, with weights nearly exact almost nothing (one set of 1000 pictures;
docs/precision.md). GPTQ rounds a product's input rows one at a time and spreads each row's rounding error over the
rows not yet rounded, weighted by how the calibration pictures' activations correlate (their second moment H = XᵀX),
so the product's output moves least. Convolutions are products of their input's patches. Written here:
onnxruntime's own GPTQ (4-bit MatMulNBits) goes through neural-compressor 2.x, whose ONNX adaptor 3.x dropped, and
rounds for other operators than the QDQ int8 graph onnxruntime runs fast.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

log = logging.getLogger("d2export")

DAMPING = 0.01  # of H's mean diagonal, added to it: H of a few pictures is near singular
BLOCK = 128  # rows rounded between two updates of the rows after them
MAX_ROWS = 8192  # a product with more rows (a 3x3 convolution of 2048 channels: 18432) keeps its nearest rounding:
# H in float64 and its inverse would take 2.7 GB each
MAX_PATCHES = 4096  # a convolution's output positions per picture whose patches enter H: enough for its C·kh·kw rows


@dataclass
class Weight:
    """One quantised product's weight as the graph stores it (`values` int8, `scale` per output channel) and how its
    rows line up with the activation's: `layout` matmul ([K, N]), gemm_t ([N, K], Gemm transB) or conv ([N, C, kh,
    kw], rows C·kh·kw of the activation's patches, `geometry` the convolution's kernel, strides, pads, dilations)."""

    product: str
    activation: str  # the float tensor the product's activation input was quantised from
    values: str  # initializer names
    scale: str
    layout: str
    geometry: tuple = ()

    def rows(self, values: np.ndarray) -> np.ndarray:
        """The stored weight as [K, N], K along the activation rows `patches` makes."""
        return {"matmul": values, "gemm_t": values.T}.get(self.layout, values.reshape(len(values), -1).T)

    def stored(self, rows: np.ndarray, shape: tuple) -> np.ndarray:
        """`rows` [K, N] back in the graph's layout."""
        return {"matmul": rows, "gemm_t": rows.T}.get(self.layout, rows.T.reshape(shape))

    def patches(self, x: np.ndarray) -> np.ndarray:
        """The activation as the rows the product multiplies: channels last for a MatMul or Gemm; for a
        convolution every MAX_PATCHES-th output position's receptive field (C, kh, kw flattened as its weight)."""
        if self.layout != "conv":
            return x.reshape(-1, x.shape[-1])
        (kh, kw), (sh, sw), (top, left, bottom, right), (dh, dw) = self.geometry
        x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
        windows = np.lib.stride_tricks.sliding_window_view(x, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
        windows = windows[:, :, ::sh, ::sw, ::dh, ::dw].transpose(0, 2, 3, 1, 4, 5)  # [B, Ho, Wo, C, kh, kw], a view
        positions = int(np.prod(windows.shape[:3]))
        b, i, j = np.unravel_index(np.arange(0, positions, max(1, positions // MAX_PATCHES)), windows.shape[:3])
        return windows[b, i, j].reshape(len(b), -1)  # only the positions taken are copied


def quantised_weights(model) -> list[Weight]:
    """The MatMul, Gemm and (ungrouped) Conv nodes fed a quantised activation and a dequantised int8 weight per
    output channel."""
    from onnx import TensorProto

    stored = {t.name: t for t in model.graph.initializer}
    made = {o: n for n in model.graph.node for o in n.output}

    def source(name: str, op: str):
        node = made.get(name)
        return node if node is not None and node.op_type == op else None

    found = []
    for n in model.graph.node:
        if n.op_type not in ("MatMul", "Gemm", "Conv") or len(n.input) < 2:
            continue
        dq_w, dq_x = source(n.input[1], "DequantizeLinear"), source(n.input[0], "DequantizeLinear")
        q_x = source(dq_x.input[0], "QuantizeLinear") if dq_x is not None else None
        if dq_w is None or q_x is None or dq_w.input[0] not in stored:
            continue
        weight = stored[dq_w.input[0]]
        attrs = {a.name: (a.i if not a.ints else tuple(a.ints)) for a in n.attribute}
        axis = {a.name: a.i for a in dq_w.attribute}.get("axis", 1)
        if weight.data_type != TensorProto.INT8:
            continue
        if n.op_type == "Conv":
            padding = next((a.s for a in n.attribute if a.name == "auto_pad"), b"NOTSET")
            if attrs.get("group", 1) != 1 or axis != 0 or len(weight.dims) != 4 or padding != b"NOTSET":
                continue  # left as rounded
            kernel = tuple(weight.dims[2:])
            pads = attrs.get("pads", (0, 0, 0, 0))
            geometry = (kernel, attrs.get("strides", (1, 1)), (pads[0], pads[1], pads[2], pads[3]),
                        attrs.get("dilations", (1, 1)))
            found.append(Weight(n.name, q_x.input[0], dq_w.input[0], dq_w.input[1], "conv", geometry))
        elif len(weight.dims) == 2 and not attrs.get("transA", 0) and axis == (0 if attrs.get("transB", 0) else 1):
            layout = "gemm_t" if attrs.get("transB", 0) else "matmul"
            found.append(Weight(n.name, q_x.input[0], dq_w.input[0], dq_w.input[1], layout))
    return found


def second_moments(model, weights: Sequence[Weight], feeds, ops: Sequence[str] = ()) -> dict[tuple, np.ndarray]:
    """H = Σ pᵀp (float64) of each weight's activation rows p over the pictures' runs (`feeds`: dicts of graph
    inputs), by (activation, geometry): products reading one tensor alike share it. One picture at a time."""
    import onnx
    import onnxruntime

    from d2export.kernels import custom_ops

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    activations = sorted({w.activation for w in weights})
    outputs = {o.name for o in probe.graph.output}
    for name in activations:
        if name not in outputs:
            probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL  # the tensors as named
    session = onnxruntime.InferenceSession(probe.SerializeToString(), custom_ops.register(options, ops),
                                           providers=["CPUExecutionProvider"])
    readers = {(w.activation, w.geometry): w for w in weights}
    moments: dict[tuple, np.ndarray] = {}
    for feed in feeds:
        values = dict(zip(activations, session.run(activations, feed)))
        for key, weight in readers.items():
            p = weight.patches(values[weight.activation]).astype(np.float64)
            moments[key] = moments.get(key, 0) + p.T @ p
    return moments


def gptq(w: np.ndarray, scale: np.ndarray, h: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """`w` [K, N] float (a product p @ w of activation rows p), `scale` [N]: the integer weights [K, N] in
    [qmin, qmax] whose product with activations of second moment `h` [K, K] lies nearest p @ w, rounding rows in order
    of their activation's energy, each row's error carried onto the rows after it through the Cholesky factor of
    H⁻¹."""
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    dead = np.diag(h) == 0  # channels never active: their rows do not matter, round them plainly
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += DAMPING * np.mean(np.diag(h))
    order = np.argsort(-np.diag(h), kind="stable")
    w, h = w[order], h[np.ix_(order, order)]
    inverse = np.linalg.inv(h)
    u = np.linalg.cholesky((inverse + inverse.T) / 2).T  # upper: H⁻¹ = uᵀu
    q = np.empty_like(w)
    for start in range(0, len(w), BLOCK):  # the rows after a block get its errors in one product, as row by row
        end = min(start + BLOCK, len(w))
        errors = np.empty((end - start, w.shape[1]))
        for k in range(start, end):
            q[k] = np.clip(np.round(w[k] / scale), qmin, qmax)
            errors[k - start] = (w[k] - q[k] * scale) / u[k, k]
            w[k + 1:end] -= np.outer(u[k, k + 1:end], errors[k - start])
        w[end:] -= u[start:end, end:].T @ errors
    rounded = np.empty_like(q)
    rounded[order] = q
    return rounded.astype(np.int8)


def refine(model, float_weights: dict[str, np.ndarray], feeds, reduce_range: bool, ops: Sequence[str] = ()) -> int:
    """Re-rounds in place the int8 weights of `model` (QDQ, per-channel symmetric) whose float originals
    `float_weights` holds by product name (as the graph stores them), from the pictures' activations (`feeds`).
    Returns the stored weights re-rounded."""
    from onnx import numpy_helper

    qmin, qmax = (-64, 64) if reduce_range else (-127, 127)  # onnxruntime's symmetric int8 ranges
    weights = [w for w in quantised_weights(model) if w.product in float_weights]
    large = [w.product for w in weights if w.rows(float_weights[w.product]).shape[0] > MAX_ROWS]
    if large:
        log.info("gptq: %d product(s) of more than %d rows keep their nearest rounding: %s", len(large), MAX_ROWS,
                 ", ".join(large))
    weights = [w for w in weights if w.product not in large]
    moments = second_moments(model, weights, feeds, ops)
    readers: dict[str, list[Weight]] = {}  # a module called twice reads one stored weight: it is rounded for both
    for weight in weights:
        readers.setdefault(weight.values, []).append(weight)
    stored = {t.name: t for t in model.graph.initializer}
    for values, (weight, *others) in readers.items():
        original = float_weights[weight.product]
        scale = numpy_helper.to_array(stored[weight.scale]).astype(np.float64)
        h = sum(moments[r.activation, r.geometry] for r in (weight, *others))
        rows = gptq(weight.rows(original), scale, h, qmin, qmax)
        stored[values].CopyFrom(numpy_helper.from_array(weight.stored(rows, original.shape), values))
    return len(readers)


def float_originals(model) -> dict[str, np.ndarray]:
    """Each MatMul's, Gemm's and Conv's constant float weight in the graph before quantisation, by node name."""
    from onnx import numpy_helper

    stored = {t.name: t for t in model.graph.initializer}
    return {n.name: numpy_helper.to_array(stored[n.input[1]]) for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm", "Conv") and len(n.input) > 1 and n.input[1] in stored}
