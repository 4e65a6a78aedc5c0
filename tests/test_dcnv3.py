"""DCNv3 (InternImage's deformable convolution, detrex's `_C.dcnv3_forward`) without its compiled op: d2export's core
(d2export/ops/dcnv3.py) against an independent float64 reference written here from the op's definition, its
backward, and the detrex stand-in's DCNv3 module importing, running and exporting at any size and batch with the
compiled extension stood in for."""
from __future__ import annotations

import io
import itertools
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch

from d2export.ops.dcnv3 import dcnv3
from d2export.patching import apply_patches, compiled_ops

compiled_ops.install(["detrex._C"])  # before the stand-in's layers import it, as d2export.activate() would


def reference(input, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, group, gc, scale) -> np.ndarray:
    """Point by point in float64: bilinear samples of the zero-padded input at each kernel point's displaced
    position (pixel p's centre at p + 0.5), weighted by the mask."""
    x_in, off, msk = (np.asarray(t, np.float64) for t in (input, offset, mask))
    n, h, w, _ = x_in.shape
    _, ho, wo, _ = off.shape
    k = kh * kw
    off = off.reshape(n, ho, wo, group, k, 2)
    msk = msk.reshape(n, ho, wo, group, k)
    out = np.zeros((n, ho, wo, group, gc))

    def pixel(b, g, yy, xx):
        if 0 <= yy < h and 0 <= xx < w:
            return x_in[b, yy, xx, g * gc:(g + 1) * gc]
        return np.zeros(gc)

    for b, i, j, g in itertools.product(range(n), range(ho), range(wo), range(group)):
        for a, c in itertools.product(range(kw), range(kh)):  # the column outer
            p = a * kh + c
            x = j * sw + (dw * (kw - 1)) // 2 + 0.5 + (a * dw - (dw * (kw - 1)) // 2) * scale \
                + off[b, i, j, g, p, 0] * scale - pw
            y = i * sh + (dh * (kh - 1)) // 2 + 0.5 + (c * dh - (dh * (kh - 1)) // 2) * scale \
                + off[b, i, j, g, p, 1] * scale - ph
            u, v = x - 0.5, y - 0.5  # in pixel-centre units
            x0, y0 = int(np.floor(u)), int(np.floor(v))
            fx, fy = u - x0, v - y0
            value = ((1 - fy) * ((1 - fx) * pixel(b, g, y0, x0) + fx * pixel(b, g, y0, x0 + 1))
                     + fy * ((1 - fx) * pixel(b, g, y0 + 1, x0) + fx * pixel(b, g, y0 + 1, x0 + 1)))
            out[b, i, j, g] += msk[b, i, j, g, p] * value
    return out.reshape(n, ho, wo, group * gc)


CASES = {  # (N, H, W), kernel, stride, pad, dilation, group, group channels, offset scale
    "3x3, pad 1, non-square, batch 2": ((2, 5, 7), 3, 1, 1, 1, 2, 3, 1.0),
    "stride 2, dilation 2, scale 0.5": ((1, 9, 6), 3, 2, 2, 2, 1, 4, 0.5),
    "5x5 no pad, 3 groups": ((2, 8, 8), 5, 1, 0, 1, 3, 2, 1.0),
    "1 pixel wide": ((1, 6, 1), 3, 1, 1, 1, 2, 2, 1.0),
}


def _inputs(shape, kernel, stride, pad, dilation, group, gc, seed):
    g = torch.Generator().manual_seed(seed)
    n, h, w = shape
    ho, wo = ((s + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for s in (h, w))
    k = kernel * kernel
    x = torch.randn(n, h, w, group * gc, generator=g)
    offset = 3.0 * torch.randn(n, ho, wo, group * k * 2, generator=g)  # many points outside the input
    mask = torch.rand(n, ho, wo, group * k, generator=g)
    return x, offset, mask


@pytest.mark.parametrize("seed, case", enumerate(CASES.values()), ids=CASES.keys())
def test_core_matches_float64_reference(seed, case):
    shape, kernel, stride, pad, dilation, group, gc, scale = case
    x, offset, mask = _inputs(shape, kernel, stride, pad, dilation, group, gc, seed)
    args = (kernel, kernel, stride, stride, pad, pad, dilation, dilation, group, gc, scale)
    want = reference(x, offset, mask, *args)
    got = dcnv3(x, offset, mask, *args)
    assert got.shape == want.shape and np.abs(want).max() > 0.1
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-5)
    # a 1/100-pixel shift of the offsets is far outside that bound
    shifted = dcnv3(x, offset + 0.01, mask, *args).numpy()
    assert np.abs(shifted - want).max() > 1e-3


def test_stand_in_backward_is_the_forwards_gradient():
    x, offset, mask = _inputs((1, 4, 5), 3, 1, 1, 1, 2, 2, seed=9)
    args = (3, 3, 1, 1, 1, 1, 1, 1, 2, 2, 1.0)
    leaves = [t.double().requires_grad_(True) for t in (x, offset, mask)]
    grad_out = torch.randn(1, 4, 5, 4, dtype=torch.float64)
    want = torch.autograd.grad(dcnv3(*leaves, *args), leaves, grad_out)
    got = compiled_ops.dcnv3_backward(*(t.detach() for t in leaves), *args, grad_out, 64)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


def test_the_stand_ins_dcnv3_imports_runs_and_exports_at_any_size_and_batch():
    from detrex.layers.dcn_v3 import DCNv3

    torch.manual_seed(0)
    layer = DCNv3(channels=16, kernel_size=3, group=4).eval()
    with torch.no_grad():
        for p in (layer.offset.weight, layer.offset.bias):
            p.normal_(0, 1.0)  # offsets of a few pixels, not upstream's zero initialisation
    f = io.BytesIO()
    with apply_patches(model=layer, only=["dcnv3-core"]) as report, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(layer, (torch.randn(1, 10, 12, 16),), f, input_names=["x"], output_names=["y"],
                          opset_version=17, dynamo=False,
                          dynamic_axes={"x": {0: "n", 1: "h", 2: "w"}, "y": {0: "n", 1: "h", 2: "w"}})
    assert report["dcnv3-core"].hits == 1
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    for n, h, w in [(1, 10, 12), (2, 12, 10), (3, 7, 19), (1, 1, 5)]:
        x = torch.randn(n, h, w, 16)
        with torch.no_grad():
            want = layer(x).numpy()
        got = session.run(None, {"x": x.numpy()})[0]
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-5, (n, h, w)


def test_without_the_patch_the_function_does_not_export():
    from detrex.layers.dcn_v3 import DCNv3

    layer = DCNv3(channels=8, kernel_size=3, group=2).eval()
    # the compiled op's autograd Function reaches torch.onnx as a PythonOp it has no symbolic for: its converter fails
    # looking the node's arguments up
    with pytest.raises(IndexError, match=r"Argument passed to at\(\) was not in the map"), torch.no_grad(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(layer, (torch.randn(1, 6, 6, 8),), io.BytesIO(), opset_version=17, dynamo=False)
