"""Traceable replacements for operators that the ONNX exporter or its consumers reject or get wrong.

Each function computes what the torch operator computes, from operators every opset >= 11 exports (most from
opset 9), vectorised over any leading batch dimensions, with shapes read at trace time so dynamic axes stay dynamic.
`d2export.patching.operator_patches` registers them as patches; which targets need which is recorded there.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from d2export.ops.level_shapes import size_tensor

_set_item = torch._C.TensorBase.__setitem__  # the builtin, whatever torch.Tensor.__setitem__ is patched to


# ----------------------------------------------------------------------------------------------- linear algebra
def cross(a: Tensor, b: Tensor, dim: int = -1) -> Tensor:
    """torch.linalg.cross: slices and products only."""
    if a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)
    a0, a1, a2 = (a.narrow(dim, i, 1) for i in range(3))
    b0, b1, b2 = (b.narrow(dim, i, 1) for i in range(3))
    return torch.cat([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], dim)


def inverse(a: Tensor) -> Tensor:
    """torch.linalg.inv over the last two dims: closed forms up to 4x4, Gauss-Jordan with partial pivoting beyond."""
    n = a.shape[-1]
    if n == 1:
        return 1.0 / a
    if n == 2:
        (p, q), (r, s) = (row.unbind(-1) for row in a.unbind(-2))
        det = p * s - q * r
        return torch.stack([torch.stack([s, -q], -1), torch.stack([-r, p], -1)], -2) / det[..., None, None]
    if n == 3:
        r0, r1, r2 = a.unbind(-2)
        cols = torch.stack([cross(r1, r2), cross(r2, r0), cross(r0, r1)], -1)  # adjugate: A @ cols = det * I
        det = (r0 * cols[..., 0]).sum(-1)
        return cols / det[..., None, None]
    if n == 4:
        return _inverse4(a)
    return _gauss_jordan(a)


def einsum_as_matmul(equation: str, a: Tensor, b: Tensor) -> Optional[Tensor]:
    """torch.einsum of two operands as one (batched) MatMul between permutes and reshapes, where the equation is
    one: every index once per operand, each either shared by both and the output (batch), by both operands alone
    (summed) or by one operand and the output. None for any other equation (ellipses, traces, one-sided sums)."""
    inputs, arrow, out = equation.replace(" ", "").partition("->")
    left, comma, right = inputs.partition(",")
    if not (arrow and comma) or "." in equation or any(len(set(t)) != len(t) for t in (left, right, out)):
        return None
    if set(out) - set(left + right) or (set(left) ^ set(right)) - set(out) or a.dim() != len(left) \
            or b.dim() != len(right):
        return None
    batch = [c for c in out if c in left and c in right]
    free_a, free_b = [c for c in out if c not in right], [c for c in out if c not in left]
    summed = [c for c in left if c in right and c not in out]
    size = {c: a.shape[i] for i, c in enumerate(left)} | {c: b.shape[i] for i, c in enumerate(right)}

    def grouped(x: Tensor, letters: str, groups) -> Tensor:
        order = [letters.index(c) for group in groups for c in group]
        x = x.permute(order) if order != sorted(order) else x
        return x.reshape(*[size[c] for c in groups[0]], _prod([size[c] for c in groups[1]]),
                         _prod([size[c] for c in groups[2]]))

    product = grouped(a, left, (batch, free_a, summed)) @ grouped(b, right, (batch, summed, free_b))
    made = batch + free_a + free_b
    product = product.reshape(*[size[c] for c in made])
    order = [made.index(c) for c in out]
    return product.permute(order) if order != sorted(order) else product


def spatial_operand(equation: str, a: Tensor, b: Tensor) -> Optional[int]:
    """For a two-operand product whose output ends in two letters that end one 4-D operand and are absent from the
    other (Mask2Former's mask logits, "bqc,bchw->bqhw"): that operand's index, else None. A bilinear resize acts on
    those two dims alone and linearly, so resizing the product is the product with that operand resized."""
    inputs, _, out = equation.replace(" ", "").partition("->")
    letters = inputs.split(",")
    if len(letters) != 2 or len(out) != 4 or "." in equation:
        return None
    last = out[-2:]
    for i, (mine, other, x) in enumerate(((letters[0], letters[1], a), (letters[1], letters[0], b))):
        if len(mine) == 4 and x.dim() == 4 and mine[-2:] == last and not set(last) & set(other):
            return i
    return None


def _inverse4(a: Tensor) -> Tensor:
    # Laplace expansion by complementary 2x2 minors of the top (s) and bottom (c) row pairs.
    (a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23), (a30, a31, a32, a33) = (
        row.unbind(-1) for row in a.unbind(-2))
    s0, s1, s2 = a00 * a11 - a10 * a01, a00 * a12 - a10 * a02, a00 * a13 - a10 * a03
    s3, s4, s5 = a01 * a12 - a11 * a02, a01 * a13 - a11 * a03, a02 * a13 - a12 * a03
    c5, c4, c3 = a22 * a33 - a32 * a23, a21 * a33 - a31 * a23, a21 * a32 - a31 * a22
    c2, c1, c0 = a20 * a33 - a30 * a23, a20 * a32 - a30 * a22, a20 * a31 - a30 * a21
    det = s0 * c5 - s1 * c4 + s2 * c3 + s3 * c2 - s4 * c1 + s5 * c0
    rows = [
        [a11 * c5 - a12 * c4 + a13 * c3, -a01 * c5 + a02 * c4 - a03 * c3,
         a31 * s5 - a32 * s4 + a33 * s3, -a21 * s5 + a22 * s4 - a23 * s3],
        [-a10 * c5 + a12 * c2 - a13 * c1, a00 * c5 - a02 * c2 + a03 * c1,
         -a30 * s5 + a32 * s2 - a33 * s1, a20 * s5 - a22 * s2 + a23 * s1],
        [a10 * c4 - a11 * c2 + a13 * c0, -a00 * c4 + a01 * c2 - a03 * c0,
         a30 * s4 - a31 * s2 + a33 * s0, -a20 * s4 + a21 * s2 - a23 * s0],
        [-a10 * c3 + a11 * c1 - a12 * c0, a00 * c3 - a01 * c1 + a02 * c0,
         -a30 * s3 + a31 * s1 - a32 * s0, a20 * s3 - a21 * s1 + a22 * s0],
    ]
    return torch.stack([torch.stack(r, -1) for r in rows], -2) / det[..., None, None]


def _gauss_jordan(a: Tensor) -> Tensor:
    """Row-reduce [A | I] to [I | A^-1]; the loop over columns unrolls in the graph, the batch stays vectorised."""
    n = a.shape[-1]
    rows = torch.arange(n, device=a.device)
    m = torch.cat([a, torch.eye(n, dtype=a.dtype, device=a.device).expand_as(a)], -1)
    for k in range(n):
        pivot = m[..., k:, k].abs().argmax(-1, keepdim=True) + k  # largest remaining entry of column k
        order = torch.where(rows == k, pivot, torch.where(rows == pivot, k, rows))  # swap rows k and pivot
        m = m.gather(-2, order.unsqueeze(-1).expand_as(m))
        row = m[..., k:k + 1, :] / m[..., k:k + 1, k:k + 1]
        m = torch.where((rows == k).unsqueeze(-1), row, m - m[..., :, k:k + 1] * row)
    return m[..., n:]


# ---------------------------------------------------------------------------------------------------- reductions
def _reduce_flags(x: Tensor, dim, keepdim: bool, reduce) -> Tensor:
    flags = x.bool().to(torch.float32)  # float reductions: every runtime has them, unlike bool or int64 ones
    out = reduce(flags) if dim is None else reduce(flags, dim, keepdim)
    out = out > 0
    return out.to(torch.uint8) if x.dtype == torch.uint8 else out  # torch keeps uint8 for uint8 inputs


def reduce_any(x: Tensor, dim: Optional[int | Sequence[int]] = None, keepdim: bool = False) -> Tensor:
    """torch.any: a float max (no int64 ReduceSum; exports from opset 9)."""
    return _reduce_flags(x, dim, keepdim, torch.amax)


def reduce_all(x: Tensor, dim: Optional[int | Sequence[int]] = None, keepdim: bool = False) -> Tensor:
    """torch.all: a float min."""
    return _reduce_flags(x, dim, keepdim, torch.amin)


# ------------------------------------------------------------------------------------------------ index assignment
def _expand_key(key, ndim: int) -> Optional[list]:
    """The key as one entry per indexed dim (Ellipsis expanded), or None unless every entry is a tensor or `:`."""
    key = list(key) if isinstance(key, tuple) else [key]
    if not key or any(not isinstance(k, Tensor) and k is not Ellipsis and k != slice(None) for k in key):
        return None
    if key.count(Ellipsis) > 1:
        return None
    used = sum(k.dim() if isinstance(k, Tensor) and k.dtype == torch.bool else 1 for k in key if k is not Ellipsis)
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key[i:i + 1] = [slice(None)] * (ndim - used)
    return key


def setitem(x: Tensor, key, value) -> bool:
    """`x[key] = value` in forms that export and run right; returns False (nothing done) for other keys.

    A boolean mask (after any `:` / `...`) becomes one `where` when the value broadcasts over the selected elements:
    no data-dependent NonZero, and values of any broadcastable shape (the exporter's ScatterND form fails on those).
    Integer index tensors keep ScatterND, with the value expanded to the indexed shape first for the same reason.
    """
    parts = _expand_key(key, x.dim())
    tensors = [k for k in parts or () if isinstance(k, Tensor)]
    if not tensors:
        return False
    if len(tensors) == 1 and tensors[0].dtype == torch.bool:
        mask = tensors[0]
        lead = parts.index(mask)
        rest = x.dim() - lead - mask.dim()
        value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
        while value.dim() > rest and value.shape[0] == 1:
            value = value[0]
        if value.dim() > rest:  # one value per selected element: only the original's scatter can place them
            return False
        x.copy_(torch.where(mask.reshape(mask.shape + (1,) * rest), value, x))
        return True
    if any(t.dtype == torch.bool or t.is_floating_point() for t in tensors) or not isinstance(value, Tensor):
        return False
    target = x[key]
    if value.shape == target.shape:
        return False
    _set_item(x, key, value.to(x.dtype).expand_as(target))
    return True


def index_accumulate(x: Tensor, indices: Sequence[Tensor], values: Tensor) -> Tensor:
    """x with `values` added at `indices` (index tensors for x's leading dims), repeated indices adding up, as
    `index_put(..., accumulate=True)` does in eager (the exported ScatterND keeps only one of them)."""
    lead = x.shape[:len(indices)]
    flat = torch.zeros((), dtype=torch.long, device=x.device)
    for idx, size in zip(indices, lead):
        idx = idx.long()  # negatives wrap as in eager (not by remainder: torch.export's size is no ONNX operand)
        flat = flat * size + torch.where(idx < 0, idx + size, idx)  # row-major position
    rest = x.shape[len(indices):]
    values = values.to(x.dtype).expand(flat.shape + rest).reshape(-1, *rest)
    one_hot = (flat.reshape(-1, 1) == torch.arange(_prod(lead), device=x.device)).to(x.dtype)
    added = one_hot.t() @ values.reshape(values.shape[0], -1)
    return x + added.reshape(x.shape)


def _prod(sizes) -> int:
    out = 1
    for s in sizes:
        out = out * s
    return out


def index_add(x: Tensor, dim: int, index: Tensor, source: Tensor, alpha=1) -> Tensor:
    """torch.index_add: repeated indices add up (the exporter's form keeps one)."""
    source = source if alpha == 1 else source * alpha
    out = index_accumulate(x.movedim(dim, 0), (index,), source.movedim(dim, 0))
    return out.movedim(0, dim)


# ------------------------------------------------------------------------------------------------------- pooling
def _bins(in_size, out_size: int, device) -> Tensor:
    """[out, in] membership of input positions in adaptive-pooling bin i: [floor(i*in/out), ceil((i+1)*in/out))."""
    i = torch.arange(out_size, device=device)
    start = torch.div(i * in_size, out_size, rounding_mode="floor")
    end = torch.div((i + 1) * in_size + out_size - 1, out_size, rounding_mode="floor")
    pos = torch.arange(in_size, device=device)
    return (pos >= start[:, None]) & (pos < end[:, None])


def _pair(size) -> tuple:
    return tuple(size) if isinstance(size, (tuple, list)) else (size, size)


def adaptive_avg_pool2d(x: Tensor, output_size) -> Tensor:
    """F.adaptive_avg_pool2d for any output size, also not dividing the input, also with dynamic H, W:
    two averaging matrices, out = Ph @ x @ Pw^T."""
    oh, ow = _pair(output_size)
    if oh is not None:
        ph = _bins(x.shape[-2], oh, x.device).to(x.dtype)
        x = (ph / ph.sum(-1, keepdim=True)) @ x
    if ow is not None:
        pw = _bins(x.shape[-1], ow, x.device).to(x.dtype)
        x = x @ (pw / pw.sum(-1, keepdim=True)).t()
    return x


def adaptive_max_pool2d(x: Tensor, output_size) -> Tensor:
    """F.adaptive_max_pool2d (values only): bins are rectangles, so a masked max over rows, then over columns."""
    oh, ow = _pair(output_size)
    if oh is not None:
        bh = _bins(x.shape[-2], oh, x.device)  # [oh, H]
        x = torch.where(bh[:, :, None], x[..., None, :, :], float("-inf")).amax(-2)
    if ow is not None:
        bw = _bins(x.shape[-1], ow, x.device)  # [ow, W]
        x = torch.where(bw, x[..., :, None, :], float("-inf")).amax(-1)
    return x


# ------------------------------------------------------------------------------------------------- interpolation
def _as_float(size, dtype=torch.float32) -> Tensor:
    """A size as a 0-d float tensor: traced sizes (0-d tensors, torch.export's SymInts) stay in the graph, Python ints
    become constants."""
    if isinstance(size, (Tensor, torch.SymInt)):
        return size_tensor(size).to(dtype)
    return torch.full((), float(size), dtype=dtype)


def _linear_weights(in_size, out_size, align_corners: bool, scale: Optional[float], x: Tensor) -> Tensor:
    """[out, in] bilinear weights along one axis: a hat function around each output's source coordinate. Sizes may
    be traced 0-d tensors: nothing is read back into Python, so the graph stays size-general."""
    n_in, n_out = _as_float(in_size), _as_float(out_size)
    i = torch.arange(out_size, dtype=torch.float32, device=x.device)
    if align_corners:  # (in - 1) / (out - 1), and 0 for a single output (i is 0 there anyway)
        src = i * ((n_in - 1) / torch.clamp(n_out - 1, min=1))
    else:
        ratio = 1.0 / scale if scale else n_in / n_out
        src = ((i + 0.5) * ratio - 0.5).clamp(min=0)
    src = torch.minimum(src, n_in - 1)  # past the last pixel torch puts all weight on it
    pos = torch.arange(in_size, dtype=torch.float32, device=x.device)
    return (1 - (src[:, None] - pos[None, :]).abs()).clamp(min=0).to(x.dtype)


def _scaled(size, scale: float):
    """floor(size * scale) as torch computes it (in double precision); a traced size stays traced."""
    if isinstance(size, Tensor):
        return torch.floor(size.to(torch.float64) * scale).to(torch.long)
    return torch.sym_int(size * scale)  # a SymInt stays symbolic (int() would fix the traced value)


def interpolate_bilinear(x: Tensor, size=None, scale_factor=None, align_corners: bool = False,
                         recompute_scale_factor: Optional[bool] = None) -> Tensor:
    """F.interpolate(mode="bilinear") on [N, C, H, W] as two matrix products (no Resize node). With a scale
    factor, the output size follows the input's (traced) size."""
    h, w = x.shape[-2:]
    scales = (None, None)
    if size is not None:
        oh, ow = _pair(size)
    else:
        sh, sw = _pair(scale_factor)
        oh, ow = _scaled(h, sh), _scaled(w, sw)
        if not recompute_scale_factor:
            scales = (sh, sw)
    wh = _linear_weights(h, oh, align_corners, scales[0], x)
    ww = _linear_weights(w, ow, align_corners, scales[1], x)
    return wh @ x @ ww.t()


def interpolate_nearest(x: Tensor, size) -> Tensor:
    """F.interpolate(mode="nearest", size=...) as one Gather per resized axis, each source index computed exactly as
    torch's CPU and CUDA kernels compute it: min(floor(float(dst) * (float(in) / float(out))), in - 1), in float32.
    onnxruntime's Resize divides by out / in instead, which floors some indices one lower (114 of 3,895 size pairs
    from 8 to 89 rows): a padding mask resized so is wrong by a row at those sizes."""
    sizes = list(size) if isinstance(size, (list, tuple)) else [size] * (x.dim() - 2)
    for axis, out in enumerate(sizes, start=2):
        n = size_tensor(x.shape[axis]).to(x.device)
        scale = n.to(torch.float32) / size_tensor(out).to(device=x.device, dtype=torch.float32)
        at = torch.arange(out, device=x.device).to(torch.float32)
        x = x.index_select(axis, torch.minimum(torch.floor(at * scale).to(torch.int64), n - 1))
    return x


# ------------------------------------------------------------------------------------------------- normalisation
def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """F.group_norm from means and products (no InstanceNormalization node)."""
    groups = x.reshape(x.shape[0], num_groups, -1)
    centred = groups - groups.mean(-1, keepdim=True)
    out = (centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    affine_shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(affine_shape)
    if bias is not None:
        out = out + bias.reshape(affine_shape)
    return out


def mask_boxes(masks: Tensor) -> Tensor:
    """[N, H, W] bool masks → [N, 4] float boxes (x0, y0, x1 + 1, y1 + 1 of the set pixels; zeros for an empty mask),
    as detectron2's BitMasks.get_bounding_boxes, without its Python loop over masks (a trace bakes their count)."""
    cols, rows = masks.any(1), masks.any(2)  # [N, W], [N, H]
    xs = torch.arange(masks.shape[2], device=masks.device)
    ys = torch.arange(masks.shape[1], device=masks.device)
    past = masks.shape[1] + masks.shape[2]  # beyond any index: the minimum of an empty row or column ignores it
    boxes = torch.stack([torch.where(cols, xs, past).amin(1), torch.where(rows, ys, past).amin(1),
                         torch.where(cols, xs, -1).amax(1) + 1, torch.where(rows, ys, -1).amax(1) + 1], 1)
    return torch.where(cols.any(1)[:, None], boxes, torch.zeros_like(boxes)).to(torch.float32)
