"""The torch.export route's lint: what its capture assumed of the dynamic sizes, read off the one capture
(d2export/exporting/size_assumptions.py). Small modules whose code narrows the sizes the way model code does: a
branch on a size, a size as a Python int, divisibility, two axes compared. The graph of a branch is shown to answer
wrongly outside what the lint says it holds for, so what it reports is what the graph does."""
import numpy as np
import onnxruntime as ort
import pytest
import sympy
import torch

from d2export.exporting import lint as lint_module
from d2export.exporting.lint import lint_export
from d2export.exporting.onnx_export import export_onnx
from d2export.exporting.size_assumptions import Assumptions, _classify

AXES = {"images": {0: "batch", 2: "height", 3: "width"}}


class Clean(torch.nn.Module):
    def forward(self, x):
        return (x * 2).sum(1)


class Branch(torch.nn.Module):  # a branch on a size: the graph keeps the dummy's
    def forward(self, x):
        return x.sum(1) if x.shape[-1] > 100 else x.mean(1)


class Baked(torch.nn.Module):  # a size as a Python int
    def forward(self, x):
        return x + int(x.shape[-1])


class Divisible(torch.nn.Module):  # a branch on divisibility: a runtime assert torch.onnx drops
    def forward(self, x):
        return x.sum(1) if x.shape[2] % 32 == 0 else x.mean(1)


class Square(torch.nn.Module):  # two axes compared
    def forward(self, x):
        return x.sum(1) if x.shape[2] == x.shape[3] else x.mean(1)


def _export(module, tmp_path, size=(128, 160)):
    x = torch.randn(2, 3, *size)
    return export_onnx(module, (x,), tmp_path / "m.onnx", input_names=["images"], output_names=["out"],
                       dynamic_axes=AXES, exporter="dynamo")


def test_a_graph_for_every_size_assumes_nothing(tmp_path):
    assumed = _export(Clean(), tmp_path).size_assumptions
    assert assumed.conditions == [] and assumed.minimum == {}


def test_a_branch_on_a_size_is_a_minimum_the_graph_answers_wrongly_below(tmp_path):
    result = _export(Branch(), tmp_path)
    assert result.size_assumptions.minimum == {"width": 101} and result.size_assumptions.conditions == []
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    for width, right in ((101, True), (100, False)):  # the graph took the dummy's branch: wrong from 100 down
        x = torch.randn(1, 3, 40, width)
        out = session.run(None, {"images": x.numpy()})[0]
        assert np.allclose(out, Branch()(x).numpy(), atol=1e-5) is right


@pytest.mark.parametrize("module, said", [
    (Baked(), "images axis 3 (width) is fixed at 160"),
    (Divisible(), "Eq(Mod(height, 32), 0)"),
    (Square(), "Ne(height, width)"),
])
def test_what_the_graph_assumes_is_said_with_the_axes_names(module, said, tmp_path):
    assert _export(module, tmp_path).size_assumptions.conditions == [said]


def test_the_lint_reads_the_capture_without_a_second_export(tmp_path, monkeypatch):
    result = _export(Divisible(), tmp_path)

    def second_export(*args, **kwargs):
        raise AssertionError("the torch.export route's lint exported again")

    monkeypatch.setattr(lint_module, "export_onnx", second_export)
    report = lint_export(None, result.path, result, AXES)
    assert not report.clean and report.size_assumptions == ["Eq(Mod(height, 32), 0)"]
    assert "Eq(Mod(height, 32), 0)" in report.format()


def test_conditions_are_sorted_into_minimums_dropped_and_warned():
    width, height, batch = (sympy.Symbol(n, integer=True, positive=True) for n in ("width", "height", "batch"))
    found = Assumptions()
    _classify([sympy.Ne(sympy.floor((width - 1) / 64), 0),  # no level a single pixel: width > 64
               sympy.Ge(width, 33),  # a weaker minimum of the same axis
               sympy.Ge(width * height, 40 * 40),  # enough tokens: implied by the minimums of each axis
               sympy.Ge(height, 40),
               sympy.Ge(batch * height, 1),  # always true: dropped
               sympy.Ne(batch, 1),  # traced at 2, size-obliviously
               sympy.Eq(sympy.Mod(height, 7), 0),  # fails at large sizes too: warned
               sympy.Le(height, 1000),  # an upper bound: warned
               sympy.Ge(width * height, 100 * 100),  # fails only where both are small: a minimum of each
               sympy.Ne(height, width)], found)  # fails at large sizes too: warned
    assert found.minimum == {"width": 100, "height": 100} and found.never_one == ["batch"]
    assert found.conditions == ["Eq(Mod(height, 7), 0)", "height <= 1000", "Ne(height, width)"]
