"""The built-in operator rewrites, registered as patches with the targets that need them.

Each `when` comes from tests/test_rewrites.py's probes of torch 2.14's TorchScript-based exporter (dynamo=False) and
onnxruntime 1.31 at opsets 7-21; TensorRT conditions are reported ones, not measured here (no TensorRT on our
machines). A rewrite no target needs today stays registered for opt-in (`apply_patches(target=None, only=[...])`).
Replacements return NotImplemented for calls the original handles right.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from d2export.ops import level_shapes
from d2export.ops import tensor_ops as ops
from d2export.patching.registry import Needs, register_patch

TENSORRT = ("tensorrt",)


@register_patch("inverse", function=("torch.inverse", "torch.linalg.inv", "torch.Tensor.inverse"),
                why="aten::linalg_inv has no ONNX export at any opset")
def inverse(input, *, out=None):
    return NotImplemented if out is not None else ops.inverse(input)


@register_patch("cross", function=("torch.cross", "torch.Tensor.cross"), when=(),
                why="exports fine today (Slice/Concat, opset 7-20); kept for older exporters that lacked aten::cross")
def cross(input, other, dim=None, *, out=None):
    if out is not None:
        return NotImplemented
    if dim is None:  # torch.cross's legacy default: the first dim of size 3
        dim = next(i for i, s in enumerate(torch.broadcast_shapes(input.shape, other.shape)) if s == 3)
    return ops.cross(input, other, dim)


@register_patch("linalg-cross", function="torch.linalg.cross", when=(),
                why="exports fine today (opset 7-20); kept for older exporters that lacked aten::linalg_cross")
def linalg_cross(input, other, *, dim=-1, out=None):
    return NotImplemented if out is not None else ops.cross(input, other, dim)


def _reduce_with_dim(reduce):
    def replacement(input, dim=None, keepdim=False, *, out=None):
        return NotImplemented if out is not None else reduce(input, dim, keepdim)

    return replacement


_ANY_ALL_WHY = "aten::any/all have no export below opset 9; the rewrite reduces in float, not int64 ReduceSum"
register_patch("any", function=("torch.any", "torch.Tensor.any"), when=Needs(opsets=(1, 8)),
               why=_ANY_ALL_WHY)(_reduce_with_dim(ops.reduce_any))
register_patch("all", function=("torch.all", "torch.Tensor.all"), when=Needs(opsets=(1, 8)),
               why=_ANY_ALL_WHY)(_reduce_with_dim(ops.reduce_all))


@register_patch("index-assign", function="torch.Tensor.__setitem__",
                why="x[mask] = v and x[idx] = v with a broadcast value export to ScatterND/Reshape forms that "
                    "onnxruntime rejects at run time (opset 11-20)")
def setitem(self, key, value):
    return None if ops.setitem(self, key, value) else NotImplemented


def _index_put(input, indices, values, accumulate=False):
    if not accumulate or not input.is_floating_point() or any(i is None or i.dtype == torch.bool for i in indices):
        return NotImplemented
    return ops.index_accumulate(input, indices, values)


def _index_add(input, dim, index, source, *, alpha=1):
    return ops.index_add(input, dim, index, source, alpha) if input.is_floating_point() else NotImplemented


def _in_place(replacement):
    def patched(input, *args, **kwargs):
        out = replacement(input, *args, **kwargs)
        return out if out is NotImplemented else input.copy_(out)

    return patched


_REPEATS = " with repeated indices exports to a scatter that keeps one update: silently wrong at opset 11-20"
for _name, _paths, _replacement in [
    ("index-put-accumulate", ("torch.index_put", "torch.Tensor.index_put"), _index_put),
    ("index-put-accumulate_", ("torch.index_put_", "torch.Tensor.index_put_"), _in_place(_index_put)),
    ("index-add", ("torch.index_add", "torch.Tensor.index_add"), _index_add),
    ("index-add_", "torch.Tensor.index_add_", _in_place(_index_add)),
]:
    _op = "index_add" if "add" in _name else "index_put(accumulate=True)"
    register_patch(_name, function=_paths, why=_op + _REPEATS)(_replacement)


def _is_global(output_size) -> bool:
    return all(s == 1 for s in ((output_size,) * 2 if isinstance(output_size, int) else output_size))


@register_patch("adaptive-avg-pool2d", function="torch.nn.functional.adaptive_avg_pool2d",
                why="no export for output sizes that do not divide the input, nor for dynamic H, W (opset 7-20)")
def adaptive_avg_pool2d(input, output_size):
    return NotImplemented if _is_global(output_size) else ops.adaptive_avg_pool2d(input, output_size)


@register_patch("adaptive-max-pool2d", function="torch.nn.functional.adaptive_max_pool2d",
                why="no export for output sizes that do not divide the input, nor for dynamic H, W (opset 7-20)")
def adaptive_max_pool2d(input, output_size, return_indices=False):
    if return_indices or _is_global(output_size):
        return NotImplemented
    return ops.adaptive_max_pool2d(input, output_size)


@register_patch("interpolate-bilinear", function="torch.nn.functional.interpolate", when=Needs(opsets=(1, 10)),
                why="bilinear below opset 11: align_corners=True does not export, align_corners=False exports "
                    "wrong at 10 and fails in onnxruntime at 9")
def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False):
    if mode != "bilinear" or antialias or input.dim() != 4:
        return NotImplemented
    return ops.interpolate_bilinear(input, size, scale_factor, bool(align_corners), recompute_scale_factor)


@register_patch("interpolate-nearest", function="torch.nn.functional.interpolate",
                why="mode='nearest' to traced sizes exports to a Resize whose source index (dst / (out / in)) floors "
                    "one lower than torch's (dst * (in / out)) at some sizes: a padding mask resized for another "
                    "feature level (Deformable-DETR, TESTR, DeepSolo) is off by a row, silently")
def interpolate_nearest(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                        recompute_scale_factor=None, antialias=False):
    if mode != "nearest" or size is None or scale_factor is not None or not 3 <= input.dim() <= 5:
        return NotImplemented
    if not (torch.jit.is_tracing() or level_shapes.holds_size(size if isinstance(size, (list, tuple)) else [size])):
        return NotImplemented  # eagerly, torch's own kernel
    return ops.interpolate_nearest(input, size)


@register_patch("checkpoint-inline", function="torch.utils.checkpoint.checkpoint",
                why="gradient checkpointing (ViTAEv2 calls it whatever the mode) runs the block inside an autograd "
                    "Function the TorchScript exporter cannot trace (`unordered_map::at`); it only changes the "
                    "backward, so the export calls the block itself")
def checkpoint_inline(function, *args, use_reentrant=None, context_fn=None, determinism_check=None, debug=None,
                      preserve_rng_state=True, **kwargs):
    return function(*args, **kwargs)


@register_patch("group-norm", function="torch.nn.functional.group_norm",
                when=Needs(runtimes=TENSORRT, version_below=(8, 6)),
                why="exported as InstanceNormalization + reshapes (fine in onnxruntime, opset 7-21); TensorRT "
                    "before 8.6 imports InstanceNormalization only through a plugin")
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    return ops.group_norm(input, num_groups, weight, bias, eps)


@register_patch("grid-sample", function="torch.nn.functional.grid_sample",
                when=(Needs(opsets=(1, 15)), Needs(runtimes=TENSORRT, version_below=(8, 5))),
                why="GridSample is opset 16; TensorRT imports it from 8.5")
def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    if mode != "bilinear" or padding_mode not in ("zeros", "border") or input.dim() != 4:
        return NotImplemented
    from d2export.ops.grid_sample import bilinear_grid_sample  # owned by the MSDA work; only needed here

    return bilinear_grid_sample(input, grid, bool(align_corners), padding_mode)


@register_patch("shape-gather", graph=True, when=Needs(runtimes=TENSORRT),
                why="Gather on a Shape output ('Cannot perform gather on a shape tensor', reported for older "
                    "TensorRT parsers): Slice + Squeeze instead")
def shape_gather_to_slice(model) -> int:
    """Rewrite Gather(Shape(x), scalar constant k) into Squeeze(Slice(Shape(x), k, k+1)) in place; returns how many."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    produced_by = {out: node for node in graph.node for out in node.output}
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    nodes, count = [], 0
    for node in graph.node:
        source = produced_by.get(node.input[0]) if node.op_type == "Gather" else None
        k = constants.get(node.input[1]) if source is not None else None
        if source is None or source.op_type != "Shape" or k is None or k.ndim > 1 or k.size != 1:
            nodes.append(node)
            continue
        scalar, k = k.ndim == 0, int(k.reshape(()))
        base = f"{node.name or node.output[0]}_slice"
        bounds = [numpy_helper.from_array(np.array([v], dtype=np.int64), f"{base}_{n}")
                  for n, v in (("start", k), ("end", k + 1 if k != -1 else np.iinfo(np.int64).max), ("axes", 0))]
        graph.initializer.extend(bounds)
        sliced = f"{base}_out" if scalar else node.output[0]  # a [1]-shaped index keeps its axis
        nodes.append(helper.make_node("Slice", [node.input[0]] + [b.name for b in bounds], [sliced], base))
        if scalar:
            if opset >= 13:
                nodes.append(helper.make_node("Squeeze", [sliced, bounds[2].name], list(node.output), f"{base}_sq"))
            else:
                nodes.append(helper.make_node("Squeeze", [sliced], list(node.output), f"{base}_sq", axes=[0]))
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return count


@register_patch("einsum-as-matmul", function="torch.einsum",
                why="onnxruntime's CPU Einsum runs a batched product at a quarter of MatMul's rate (it copies the "
                    "large operand into its own layout): Mask2Former's mask predictions [1,100,256]x[1,256,200,200], "
                    "22 ms each, ten a picture; the same product as MatMul")
def einsum(equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) != 2:
        return NotImplemented
    out = ops.einsum_as_matmul(equation, *operands)
    if out is None:
        return NotImplemented
    spatial = ops.spatial_operand(equation, *operands)
    if spatial is not None:
        _remember_product(out, equation, operands, spatial)
    return out


# Products a later bilinear resize may move behind (resize-before-product), by the result's id while it lives:
# (a weak reference to it, the equation, the operands, the index of the operand holding the spatial dims).
_PRODUCTS: dict[int, tuple] = {}


def _remember_product(out, equation: str, operands, spatial: int) -> None:
    key = id(out)
    _PRODUCTS[key] = (weakref.ref(out, lambda _: _PRODUCTS.pop(key, None)), equation, tuple(operands), spatial)


def _shrinks(input, size) -> bool:
    size = tuple(size) if isinstance(size, (list, tuple, torch.Size)) else (size, size)
    hint = level_shapes.size_hint
    pairs = [(hint(o), hint(i)) for o, i in zip(size, input.shape[-2:])]
    return len(pairs) == 2 and all(o <= i for o, i in pairs) and any(o < i for o, i in pairs)


@register_patch("resize-before-product", function="torch.nn.functional.interpolate",
                why="Mask2Former's masked decoder (OneFormer's, MaskDINO's) makes every layer's mask logits at 1/4 "
                    "of the input ([1,100,256]x[1,256,H/4,W/4]) only to shrink them bilinearly to the next layer's "
                    "attention size; a bilinear resize is linear over those two dims, so the product of the shrunk "
                    "mask features is the same function, and the nine unused full-size products leave the graph")
def resize_before_product(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                          recompute_scale_factor=None, antialias=False):
    product = _PRODUCTS.get(id(input))
    if product is None or product[0]() is not input or mode != "bilinear" or align_corners or antialias \
            or size is None or scale_factor is not None or input.dim() != 4 or not _shrinks(input, size):
        return NotImplemented  # an upsampling stays: the product at the larger size would cost more
    _, equation, operands, i = product
    operands = list(operands)
    operands[i] = F.interpolate(operands[i], size=size, mode="bilinear", align_corners=False)
    return torch.einsum(equation, *operands)


_ENCODER_LAYER_FORWARD = torch.nn.TransformerEncoderLayer.forward  # torch's own, before any scope patches it


@register_patch("transformer-layer-math-path", module=torch.nn.TransformerEncoderLayer,
                why="in eval mode torch runs nn.TransformerEncoderLayer through its fused fast path "
                    "(aten::_transformer_encoder_layer_fwd), which no ONNX translation takes (SRFormer's mask "
                    "branch); the layer's own Python path computes the same, so it runs with the fast path off")
def encoder_layer_math_path(self, *args, **kwargs):
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return _ENCODER_LAYER_FORWARD(self, *args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
