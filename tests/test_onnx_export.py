"""export_onnx: atomic writes and errors that say what failed and where."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from d2export.exporting.onnx_export import ExportError, export_onnx


class Spectral(nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x).abs()  # no ONNX symbolic in the TorchScript-based exporter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.backbone = nn.Sequential(nn.ReLU(), Spectral())

    def forward(self, x):
        return self.backbone(self.stem(x))


def test_unsupported_operator_names_module_and_source_and_leaves_nothing(tmp_path):
    dst = tmp_path / "model.onnx"
    dst.write_bytes(b"previous good model")
    with pytest.raises(ExportError) as err:
        export_onnx(Net().eval(), (torch.randn(2, 8),), dst, input_names=["x"], output_names=["y"], opset=17)
    msg = str(err.value)
    assert "unsupported operator" in msg and "fft" in msg
    assert "backbone.1" in msg and "test_onnx_export.py" in msg  # the module path and the user's source line
    assert dst.read_bytes() == b"previous good model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_export_writes_a_checked_model_with_pinned_static_dims(tmp_path):
    class Heads(nn.Module):
        def forward(self, x):
            return x.flatten(1)[:, :6].reshape(-1, 3, 2) * 2

    result = export_onnx(Heads(), (torch.randn(2, 4, 5),), tmp_path / "m.onnx", input_names=["x"],
                         output_names=["y"], dynamic_axes={"x": {0: "batch", 2: "w"}, "y": {0: "batch"}})
    import onnx

    out = onnx.load(str(result.path)).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in out] == ["batch", 3, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_tracer_warnings_point_at_the_models_own_line(tmp_path):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2)

        def forward(self, x):
            return self.mha(x, x, x)[0]  # torch's checks inside raise TracerWarnings in torch/nn/functional.py

    result = export_onnx(Attn().eval(), (torch.randn(5, 1, 8),), tmp_path / "a.onnx", input_names=["x"],
                         output_names=["y"])
    assert result.tracer_warnings
    assert all(w.filename.endswith("test_onnx_export.py") for w in result.tracer_warnings)
    assert "raised in" in str(result.tracer_warnings[0].message) and "functional.py" in str(
        result.tracer_warnings[0].message)
