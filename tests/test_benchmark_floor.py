"""The benchmarks' measuring instruments: the multiply-add count behind the e2e compute floor, and the msda
benchmark's rows that split a fused call (kernel alone, kernel reading one pixel) against the reference."""
import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import e2e, msda


class _Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 8)
        self.conv = torch.nn.Conv2d(2, 4, 3)

    def forward(self, x, image, grid):
        return self.linear(x).sum() + self.conv(image).sum() + F.grid_sample(image, grid, align_corners=False).sum()


def test_model_macs_counts_products_convolutions_and_bilinear_sampling():
    x, image, grid = torch.randn(3, 16), torch.randn(1, 2, 10, 10), torch.rand(1, 5, 7, 2) * 2 - 1
    linear = 3 * 16 * 8
    conv = 4 * 2 * 3 * 3 * 8 * 8  # out channels × in channels × kernel × output pixels
    sampling = 4 * 1 * 2 * 5 * 7  # four corners per sampled value
    assert e2e.model_macs(_Mixed(), (x, image, grid)) == linear + conv + sampling


def test_msda_kernel_rows_compute_the_reference_call():
    inputs = msda.make_inputs(64, 40)
    expected = msda.reference_msda(*[t.double() if t.is_floating_point() else t for t in inputs])
    alone = msda.build_runner("fused kernel alone", inputs, threads=1)()
    np.testing.assert_allclose(alone, expected.numpy(), atol=2e-5)
    one_pixel = msda.build_runner("fused kernel alone, every point at one pixel", inputs, threads=1)()
    assert one_pixel.shape == expected.shape and not np.allclose(one_pixel, expected.numpy(), atol=1e-3)


def test_msda_fused_rows_each_run_their_own_kernel(monkeypatch):
    """The benchmark's two fused rows compute the reference call, each through the kernel its name says."""
    from d2export.kernels import custom_ops

    served = []
    register = custom_ops.register
    monkeypatch.setattr(custom_ops, "register", lambda options, ops: served.append(custom_ops.kernel().name)
                        or register(options, ops))
    inputs = msda.make_inputs(64, 40)
    expected = msda.reference_msda(*[t.double() if t.is_floating_point() else t for t in inputs]).numpy()
    for name in (msda.FUSED, msda.FUSED_NUMBA):
        np.testing.assert_allclose(msda.build_runner(name, inputs, threads=1)()[0], expected, atol=2e-5)
    assert served == ["native", "numba"]
