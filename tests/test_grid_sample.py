"""bilinear_grid_sample: F.grid_sample's results (4-D, bilinear, zeros/border, both align_corners) without GridSample."""
import io

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from d2export.ops.grid_sample import bilinear_grid_sample
from msda_reference import grid_sample_reference

torch.set_num_threads(1)

MODES = [(ac, pm) for ac in (False, True) for pm in ("zeros", "border")]


def _inputs(n, c, h, w, gh, gw, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(n, c, h, w, generator=gen, dtype=dtype)
    grid = torch.rand(n, gh, gw, 2, generator=gen, dtype=dtype) * 2.4 - 1.2  # ~10% outside
    return image, grid


def _close(out, ref, atol):
    assert out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err < atol, f"max abs error {err}"


@pytest.mark.parametrize("align_corners,padding_mode", MODES)
@pytest.mark.parametrize("size", [(1, 3, 5, 7, 4, 6), (2, 2, 8, 3, 5, 2), (3, 4, 1, 6, 3, 3), (2, 1, 4, 1, 2, 5)])
def test_parity(size, align_corners, padding_mode):
    image, grid = _inputs(*size)
    out = bilinear_grid_sample(image, grid, align_corners, padding_mode)
    _close(out, grid_sample_reference(image, grid, align_corners, padding_mode), 2e-6)
    _close(out, F.grid_sample(image, grid, "bilinear", padding_mode, align_corners).double(), 2e-6)


@pytest.mark.parametrize("align_corners,padding_mode", MODES)
def test_edges_float64(align_corners, padding_mode):
    """Grid points on pixel centres and edges, on the border, beyond it, far outside; float64 is exact."""
    h, w = 3, 4
    xs = torch.tensor([k / w for k in range(-w - 3, w + 4)] + [-7.0, 1e6], dtype=torch.float64)
    ys = torch.tensor([k / h for k in range(-h - 3, h + 4)] + [5.0, -1e6], dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(xs, ys, indexing="ij"), -1).unsqueeze(0)
    image = torch.randn(1, 2, h, w, dtype=torch.float64)
    out = bilinear_grid_sample(image, grid, align_corners, padding_mode)
    assert out.dtype == torch.float64
    _close(out, grid_sample_reference(image, grid, align_corners, padding_mode), 1e-12)


@pytest.mark.parametrize("align_corners,padding_mode", MODES)
def test_gradients(align_corners, padding_mode):
    image, grid = _inputs(2, 3, 5, 4, 3, 2, dtype=torch.float64)
    image.requires_grad_(), grid.requires_grad_()
    got = torch.autograd.grad(bilinear_grid_sample(image, grid, align_corners, padding_mode).square().sum(),
                              (image, grid))
    ref = torch.autograd.grad(grid_sample_reference(image, grid, align_corners, padding_mode).square().sum(),
                              (image, grid))
    for g, r in zip(got, ref):
        assert g.abs().max() > 0
        _close(g, r, 1e-10)


def test_float16():
    image, grid = _inputs(1, 3, 40, 300, 5, 7)
    out = bilinear_grid_sample(image.half(), grid.half())
    assert out.dtype == torch.float16
    _close(out, grid_sample_reference(image.half(), grid.half()), 5e-3)


class _Sampler(torch.nn.Module):
    def __init__(self, align_corners, padding_mode):
        super().__init__()
        self.align_corners, self.padding_mode = align_corners, padding_mode

    def forward(self, image, grid):
        return bilinear_grid_sample(image, grid, self.align_corners, self.padding_mode)


@pytest.mark.parametrize("align_corners,padding_mode", MODES)
def test_onnx_opset11_other_sizes(align_corners, padding_mode):
    buf = io.BytesIO()
    torch.onnx.export(_Sampler(align_corners, padding_mode), _inputs(2, 3, 6, 4, 3, 5), buf,
                      input_names=["image", "grid"], output_names=["out"], opset_version=11, dynamo=False,
                      dynamic_axes={"image": {0: "n", 2: "h", 3: "w"}, "grid": {0: "n", 1: "gh", 2: "gw"}})
    model = onnx.load_from_string(buf.getvalue())
    onnx.checker.check_model(model, full_check=True)
    assert "GridSample" not in {n.op_type for n in model.graph.node}
    session = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    for seed, size in enumerate([(1, 3, 4, 6, 2, 2), (3, 3, 9, 5, 4, 1), (2, 3, 1, 7, 3, 3)]):
        image, grid = _inputs(*size, seed=seed)
        out = torch.from_numpy(session.run(None, {"image": image.numpy(), "grid": grid.numpy()})[0])
        _close(out, grid_sample_reference(image, grid, align_corners, padding_mode), 2e-6)


def test_rejects_5d():
    with pytest.raises(ValueError):
        bilinear_grid_sample(torch.zeros(1, 1, 2, 2, 2), torch.zeros(1, 1, 1, 1, 3))
