"""Multi-scale deformable attention (MSDA) core in pure PyTorch: traceable, exact, device-safe.

Same tensor signature and semantics as the compiled Deformable-DETR op: bilinear sampling with zero padding and
align_corners=False, i.e. what `F.grid_sample(value_l, 2 * loc - 1)` computes per level, weighted by the attention
weights and summed over levels and points.

Samplers (pick one with `sampler=`; "auto" picks for you):
- "gather": every level, point and corner at once: one Gather of the 2×2 windows' pixels and one MatMul with
  bilinear × attention weights (see `_bilinear`), in pieces of the queries for an encoder. Only opset-11 ops, no
  GridSample node; the fastest exported to onnxruntime on the CPU, safe for TensorRT.
- "grid_sample": one F.grid_sample per level (GridSample nodes, opset >= 16).
- "pytorch": the fastest formulation eagerly in PyTorch (one grid_sample per level, levels' sizes read once).
- "trt_plugin": exports one `MultiscaleDeformableAttnPlugin_TRT` node for TensorRT; computes like "gather" eagerly.
- "fused": exports one `d2export.MultiScaleDeformableAttention` node, run on the CPU by d2export's compiled kernel
  (`d2export.kernels.custom_ops`: onnxruntime-extensions + numba, the `fused` extra); computes like "gather" eagerly.
"auto" is "pytorch" eagerly and, while tracing or exporting, "gather" or whatever `use_sampler(...)` set.

No sampler turns spatial_shapes or level_start_index into Python numbers while tracing, so a graph exported at one
image size computes correctly at any other.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.nn.functional as F

from . import SAMPLERS
from ._bilinear import bilinear_window
from .level_shapes import level_shapes, level_starts, static_size

EXPORT_DEFAULT = "gather"
# the gather sampler's queries are processed in this many pieces (peak memory / QUERY_CHUNKS; see _gather). More,
# smaller pieces (64, 128: a piece's gathered pixels then stay in the caches) made one encoder call 20-30% faster but
# measured no faster end to end in the R-50 spotter (docs/performance.md), for 1,150-2,700 more nodes.
QUERY_CHUNKS = 16

_export_sampler = contextvars.ContextVar("d2export_msda_export_sampler", default=EXPORT_DEFAULT)


@contextlib.contextmanager
def use_sampler(name: str) -> Iterator[None]:
    """Within the block, "auto" resolves to `name` while tracing/exporting (eager calls keep "pytorch")."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown MSDA sampler {name!r}; choose from {SAMPLERS}")
    token = _export_sampler.set(EXPORT_DEFAULT if name == "auto" else name)
    try:
        yield
    finally:
        _export_sampler.reset(token)


def is_exporting() -> bool:
    """True while the TorchScript tracer, torch.onnx.export or torch.export is recording the graph."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


def resolve_sampler(sampler: str = "auto") -> str:
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown MSDA sampler {sampler!r}; choose from {SAMPLERS}")
    if sampler != "auto":
        return sampler
    return _export_sampler.get() if is_exporting() else "pytorch"


def multi_scale_deformable_attention(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                     level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                                     attention_weights: torch.Tensor, *, sampler: str = "auto") -> torch.Tensor:
    """value [N, S, M, D], spatial_shapes [L, 2] (H, W) integer, level_start_index [L],
    sampling_locations [N, Lq, M, L, P, 2] normalised (x, y) — outside [0, 1] reads zero padding —,
    attention_weights [N, Lq, M, L, P]  ->  [N, Lq, M * D] in value's dtype.

    Half-precision inputs are computed in float32 (pixel coordinates in float16 are off by up to 1/8 px at 256 px),
    and so is everything under autocast.
    """
    device = value.device.type
    if _autocasting(device):  # autocast would run the samplers' MatMul in half precision
        with torch.autocast(device, enabled=False):
            return multi_scale_deformable_attention(value, spatial_shapes, level_start_index, sampling_locations,
                                                    attention_weights, sampler=sampler)
    name = resolve_sampler(sampler)
    if name == "trt_plugin":
        return _TRTPluginMSDA.apply(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    compute = torch.promote_types(value.dtype, torch.float32)
    args = (_to(value, compute), spatial_shapes, level_start_index, _to(sampling_locations, compute),
            _to(attention_weights, compute))
    if name == "fused":  # torch.export records the custom op, fused_op_translation makes it the same node
        out = fused_msda(*args) if torch.compiler.is_exporting() else _FusedMSDA.apply(*args)
    else:
        out = _gather(*args) if name == "gather" else _per_level_grid_sample(*args)
    return _to(out, value.dtype)


def _autocasting(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; no node in the graph when it is already (the tracer records even a no-op `.to`)."""
    return t if t.dtype == dtype else t.to(dtype)


def _level_bounds(spatial_shapes):
    """[(H, W, start), ...] per level, never read from tensor values while exporting: 0-d tensors under the
    TorchScript tracer and SymInts under torch.export (see `level_shapes`), so the graph keeps following the feature
    maps' sizes; Python ints eagerly (one device sync)."""
    shapes = level_shapes(spatial_shapes)
    return [(h, w, start) for (h, w), start in zip(shapes, level_starts(shapes))]


def _token_count(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """S of value [N, S, M, D] as a 1-element tensor of the index dtype. A traced size (or any 0-d tensor, which the
    TorchScript exporter promotes like a Python scalar) would turn the whole index int64 in the graph; torch.export
    has no `_shape_as_tensor`, and `scalar_tensor` keeps its SymInt symbolic."""
    if torch.compiler.is_exporting():
        return torch.scalar_tensor(value.shape[1], dtype=dtype, device=value.device).view(1)
    return torch._shape_as_tensor(value)[1:2].to(device=value.device, dtype=dtype)


def _gather(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, chunks=QUERY_CHUNKS):
    """Every level, point and corner at once: one Gather of 2×2 windows' pixels and one MatMul per piece of the
    queries."""
    n, s, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    # Per-level numbers as [L, P]: they match the trailing dims of [N, Lq, M, L, P], which onnxruntime broadcasts
    # as a repeated vector; an [L, 1] operand takes its slow general path (measured 3-8x slower per op).
    level_shape = (n_levels, n_points)
    height, width = (v.unsqueeze(-1).expand(level_shape) for v in spatial_shapes.to(value.dtype).unbind(1))
    # align_corners=False: normalised 0 and 1 are the outer edges of the border pixels
    x = sampling_locations[..., 0] * width - 0.5
    y = sampling_locations[..., 1] * height - 0.5
    offset, weight = bilinear_window(x, y, width, height, "zeros", scale=attention_weights)  # [N,Lq,M,L,P], [.., 4]
    # Row of value.reshape(N * S * M, D) for (batch b, token t, head h) is (b * S + t) * M + h.
    # int32 indices gather faster than int64 in onnxruntime; N * S * M stays far below 2**31.
    idx = offset.dtype
    # the head count is the model's structure: a constant in the graph, not a size read back from value's shape (on
    # a GPU each size read here is a host-to-device copy: S and M per MSDA call were 36 of the R-50 spotter's 56)
    s_, m_ = _token_count(value, idx), static_size(m)
    batch = torch.arange(n, dtype=idx, device=value.device).view(n, 1, 1, 1, 1) * s_
    head = torch.arange(m, dtype=idx, device=value.device).view(1, 1, m, 1, 1)
    base = (batch + level_start_index.to(idx).unsqueeze(-1).expand(level_shape)) * m_ + head  # [N, 1, M, L, P]
    rows = offset * m_ + base  # the window's top-left pixel
    taps = n_levels * n_points * 4
    # Four D-wide rows per window, straight from value: pixels +1 and +W (+1) are M and W * M rows on. (A table of
    # 2×2 windows, one 4D-wide row each, was measured no faster at 640² and 15% slower at 1024², at ~4 copies of
    # value.) A 1-pixel-wide (-high) level has no right (lower) neighbour, possibly not even a next row: read the
    # window's own pixel there instead, which the weight of 0 cancels.
    dx = (width > 1).to(width.dtype)
    dy = width * (height > 1).to(width.dtype)
    corners = torch.stack([torch.zeros_like(dx), dx, dy, dx + dy], -1)  # [L, P, 4]
    rows = rows.unsqueeze(-1) + corners.to(idx) * m_  # [N, Lq, M, L, P, 4]
    pixels = value.reshape(n * s * m, d)
    pieces = chunks if _self_attention(lq, s) else 1  # Lq = S: the gathered block grows with the image
    # In pieces along the queries: the gathered pixels (Lq·M·taps·D floats, 3.5 GB per encoder call at 1600²) exist
    # one piece at a time. The bounds are computed from Lq, so the graph stays size-general; heads, taps and D are the
    # model's structure, constants in the graph, so a piece's reshapes cost no shape arithmetic.
    m, d, taps = static_size(m), static_size(d), static_size(taps)
    rows = rows.reshape(-1, m, taps)  # [N * Lq, M, taps]
    weight = weight.reshape(-1, m, 1, taps)
    out = _by_pieces(lambda r, w: torch.matmul(w, F.embedding(r, pixels)), rows, weight, pieces)  # [N * Lq, M, 1, D]
    return out.view(n, lq, m * d)


def _by_pieces(fn, rows: torch.Tensor, weight: torch.Tensor, pieces: int) -> torch.Tensor:
    """fn(rows, weight) over `pieces` consecutive parts of both along dim 0, concatenated."""
    if pieces == 1:
        return fn(rows, weight)
    if torch.compiler.is_exporting():
        # torch.export: parts of one symbolic size, padded at the end with row 0 at weight 0, whose results are
        # dropped. Parts of sizes ⌊Q·(i+1)/pieces⌋ - ⌊Q·i/pieces⌋ cost the shape algebra (sympy) of every op
        # once per part: with 16 such parts the tiny spotter's export took 2.5x as long. A row more than needed
        # keeps a part from being 1 row: a size of 1 is a special case to torch.export's shape checks (a guard
        # `size != 1` in the program), so a program traced at a larger size would refuse small images.
        total = rows.shape[0]
        size = (total + pieces - 1) // pieces + 1
        rows, weight = (F.pad(t, [0, 0] * (t.dim() - 1) + [0, size * pieces - total]) for t in (rows, weight))
        parts = [(rows[i * size:(i + 1) * size], weight[i * size:(i + 1) * size]) for i in range(pieces)]
        return torch.cat([fn(r, w) for r, w in parts], 0)[:total]
    return torch.cat([fn(r, w) for r, w in _pieces(rows, weight, pieces)], 0)


def _pieces(rows: torch.Tensor, weight: torch.Tensor, pieces: int) -> list:
    """(rows, weight) cut into `pieces` consecutive parts along dim 0, some possibly empty."""
    if not (torch.jit.is_tracing() and torch.onnx.is_in_onnx_export()):
        # eagerly and under torch.jit.trace (traced sizes; a saved TorchScript module cannot hold the Python Function
        # below)
        bounds = [rows.shape[0] * i // pieces for i in range(pieces + 1)]
        return [(rows[a:b], weight[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    # the TorchScript-based ONNX exporter: every bound at once, then one Slice per operand and piece (slicing at 0-d
    # traced bounds costs casts, unsqueezes and a division per piece and operand: 2,285 of the R-50 spotter's 14,599
    # nodes)
    total = torch._shape_as_tensor(rows)[:1]  # on the CPU, like the bounds: sizes, wherever rows lives
    bounds = torch.div(torch.arange(pieces + 1) * total, pieces, rounding_mode="trunc")
    starts, axes = bounds.split(1), torch.zeros(1, dtype=torch.long)  # one Split, one constant
    return [(_Rows.apply(rows, a, b, axes), _Rows.apply(weight, a, b, axes)) for a, b in zip(starts[:-1], starts[1:])]


class _Rows(torch.autograd.Function):
    """x[start:end] along dim 0 for 1-element int64 tensors start and end (axes: [0]), exported as one Slice node."""

    @staticmethod
    def forward(ctx, x, start, end, axes):
        with _untraced():
            return x[int(start):int(end)]

    @staticmethod
    def symbolic(g, x, start, end, axes):
        return g.op("Slice", x, start, end, axes)


def _self_attention(len_q, len_in) -> bool:
    """Whether the queries are the value's own tokens (an encoder: Lq = S, growing with the image), known from the
    shapes' structure rather than the traced numbers: a decoder's fixed query count may equal S at one size only."""
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true
    except ImportError:  # older torch
        def statically_known_true(x):
            return bool(x)
    # TorchScript tracing: 0-d tensors; torch.export: the encoder's Lq and S are the same symbolic expression
    len_q, len_in = static_size(len_q), static_size(len_in)
    return statically_known_true(len_q == len_in)


def _per_level_grid_sample(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """One F.grid_sample per level over all heads at once (Deformable-DETR's formulation)."""
    n, s, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    per_head = value.permute(0, 2, 3, 1).reshape(n * m, d, s)
    grids = (2 * sampling_locations - 1).transpose(1, 2).reshape(n * m, lq, n_levels, n_points, 2)
    samples = [F.grid_sample(per_head[:, :, start:start + h * w].reshape(n * m, d, h, w), grids[:, :, level],
                             mode="bilinear", padding_mode="zeros", align_corners=False)  # [N*M, D, Lq, P]
               for level, (h, w, start) in enumerate(_level_bounds(spatial_shapes))]
    sampled = torch.stack(samples, dim=-2).reshape(n * m, d, lq, n_levels * n_points)
    weight = attention_weights.transpose(1, 2).reshape(n * m, 1, lq, n_levels * n_points)
    out = (sampled * weight).sum(-1)  # [N*M, D, Lq]
    return out.view(n, m * d, lq).transpose(1, 2)


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """The eager value of a Function that exports as one node: its body computed outside the TorchScript tracer,
    whose record of it (thrown away for the node) breaks on sizes traced elsewhere in the model."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


class _FusedMSDA(torch.autograd.Function):
    """Eagerly the gather formulation; exported as one node of d2export's custom domain (float32 and int64 operands,
    the types its kernel is declared with)."""

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        with _untraced():
            return _gather(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, chunks=1)

    @staticmethod
    def symbolic(g, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        from d2export.kernels.custom_ops import DOMAIN, FUSED_MSDA

        float32, int64 = 1, 7  # onnx.TensorProto.FLOAT, INT64
        out = g.op(f"{DOMAIN}::{FUSED_MSDA}", _cast(g, value, float32), _cast(g, spatial_shapes, int64),
                   _cast(g, level_start_index, int64), _cast(g, sampling_locations, float32),
                   _cast(g, attention_weights, float32))
        return out.setType(value.type().with_sizes(_output_sizes(value, sampling_locations)))


@torch.library.custom_op("d2export::fused_msda", mutates_args=())
def fused_msda(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
               sampling_locations: torch.Tensor, attention_weights: torch.Tensor) -> torch.Tensor:
    """The fused node for torch.export (an autograd.Function's symbolic is TorchScript's alone): eagerly the gather
    formulation, recorded as one op that d2export.exporting.fused_op_translation makes the custom-domain node."""
    return _gather(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, chunks=1)


@fused_msda.register_fake
def _fused_msda_sizes(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    n, _, m, d = value.shape
    return value.new_empty((n, sampling_locations.shape[1], m * d))


def _output_sizes(value, sampling_locations) -> list[int | None]:
    """The node's output sizes (N, Lq, H·D) as far as the exporter knows its operands' (None where a size is
    dynamic). Without them no size after the first MSDA is known, and a fixed-size graph keeps the shape arithmetic
    that onnxruntime would otherwise fold (on a GPU: work on the host and copies to the device)."""
    v, loc = value.type().varyingSizes() or [None] * 4, sampling_locations.type().varyingSizes() or [None] * 6
    channels = v[2] * v[3] if len(v) == 4 and v[2] is not None and v[3] is not None else None
    return [v[0] if v else None, loc[1] if len(loc) > 1 else None, channels]


def _cast(g, x, to: int):
    """x as ONNX type `to`; no node where it is that already."""
    dtypes = {1: torch.float32, 7: torch.int64}
    return x if x.type().dtype() == dtypes[to] else g.op("Cast", x, to_i=to)


class _TRTPluginMSDA(torch.autograd.Function):
    """Eagerly the gather formulation; exported as TensorRT's MultiscaleDeformableAttnPlugin_TRT node."""

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        compute = torch.promote_types(value.dtype, torch.float32)
        with _untraced():
            out = _gather(_to(value, compute), spatial_shapes, level_start_index, _to(sampling_locations, compute),
                          _to(attention_weights, compute), chunks=1)
        return _to(out, value.dtype)

    @staticmethod
    def symbolic(g, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        int32 = 6  # onnx.TensorProto.INT32: the plugin's layout for shapes and starts
        out = g.op("trt::MultiscaleDeformableAttnPlugin_TRT", value, g.op("Cast", spatial_shapes, to_i=int32),
                   g.op("Cast", level_start_index, to_i=int32), sampling_locations, attention_weights)
        return out.setType(value.type().with_sizes(_output_sizes(value, sampling_locations)))
