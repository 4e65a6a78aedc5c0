"""The torch.export route's lint: what its capture assumed of the dynamic sizes, read off the one capture
(d2export/exporting/size_assumptions.py). Small modules whose code narrows the sizes the way model code does: a
branch on a size, a size as a Python int, divisibility, two axes compared. The graph of a branch is shown to answer
wrongly outside what the lint says it holds for, so what it reports is what the graph does."""
import numpy as np
import onnxruntime as ort
import pytest
import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

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


def test_a_graph_for_every_size_assumes_nothing(tmp_path, caplog):
    with caplog.at_level("INFO", logger="d2export"):
        assumed = _export(Clean(), tmp_path).size_assumptions
    assert assumed.conditions == [] and assumed.minimum == {}
    # the route's phases are said as they end (minutes each on a full-size model)
    said = [r.getMessage().split(" in ")[0] for r in caplog.records if r.name.startswith("d2export")]
    assert said == ["torch.export captured the program", "torch.onnx decomposed and translated it",
                    "onnxscript folded its constants"]


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
               sympy.Ne(height, width),  # fails at large sizes too: warned
               sympy.Ne(width, 2047)],  # holds where traced, fails above: no minimum of 2048, warned
              found, traced={"width": 256, "height": 256, "batch": 2})
    assert found.minimum == {"width": 100, "height": 100} and found.never_one == ["batch"]
    assert found.conditions == ["Eq(Mod(height, 7), 0)", "height <= 1000", "Ne(width, 2047)", "Ne(height, width)"]


def test_a_condition_that_divides_by_zero_at_small_sizes_fails_there():
    """A level's size divides (ViTAEv2's cells): below 64 the level has no pixels, the condition no value."""
    height = sympy.Symbol("height", integer=True, positive=True)
    found = Assumptions()
    _classify([sympy.Gt(FloorDiv(4096, FloorDiv(height, 64)), 1)], found)
    assert found.minimum == {"height": 64} and found.conditions == []


class SameEitherSide(torch.nn.Module):  # a branch on a size whose two sides compute the same
    def forward(self, x):
        return x.sum(1) if x.shape[-1] > 100 else x.flip(1).sum(1)


def _subject(module, path):
    """What check_below_minimums reads of the pipeline's Built: the config's tolerances and dummy size, a family
    with no special outputs, and an adapter that feeds pictures to `module` (the eager side)."""
    from types import SimpleNamespace

    from d2export.config import load
    from d2export.verification.subject import Subject

    cfg = load("textdet_tiny", [f"export.output_dir={path.parent}", "export.dummy_sizes=[[128,160]]"])
    adapter = SimpleNamespace(
        output_names=["out"],
        graph_inputs=lambda images: {"images": np.stack(images).astype(np.float32)},
        reference=lambda images: [module(torch.from_numpy(np.stack(images).astype(np.float32))).numpy()])
    built = SimpleNamespace(cfg=cfg, adapter=adapter, family=SimpleNamespace(output_kinds={}, sorted_by=None))
    return Subject(built, path, [])


@pytest.mark.parametrize("module, held, failed", [(SameEitherSide(), True, None), (Branch(), False, "128x100")])
def test_below_a_minimum_the_graph_is_tried_against_the_model(module, held, failed, tmp_path):
    from d2export.verification.float32 import check_below_minimums, sizes_below

    result = _export(module, tmp_path)
    assert result.size_assumptions.minimum == {"width": 101}
    assert sizes_below({"width": 101}, (128, 160)) == [(128, 100), (128, 50), (128, 25), (128, 12)]
    below = check_below_minimums(_subject(module, result.path), result.size_assumptions.minimum)
    assert below["held"] is held and below["failed"] == failed
    assert below["tried"] == ["128x100", "128x50", "128x25", "128x12"]
    report = lint_export(None, result.path, result, AXES)
    report.below_minimum = below
    assert report.serve_from == ({} if held else {"width": 101})  # what the runtime pads smaller pictures up to
    assert ("served at any size" if held else "pads smaller pictures") in report.format()


def test_sizes_below_walk_each_axis_with_a_minimum_down_by_halves():
    from d2export.verification.float32 import sizes_below

    assert sizes_below({"width": 65, "height": 65}, (160, 224)) == [(64, 64), (32, 32), (16, 16), (8, 8)]
    assert sizes_below({"height": 33, "width": 129}, (160, 224)) == [(32, 128), (16, 64), (8, 32), (8, 16), (8, 8)]
    assert sizes_below({}, (160, 224)) == [] and sizes_below({"width": 9}, (160, 224)) == [(160, 8)]


def test_a_minimum_nothing_below_could_test_pads_nothing():
    """Where the model itself fails below a minimum, the graph is served as exported: padding every smaller picture
    (up to a minimum the sampled classification may have misread) would change answers nothing showed wrong."""
    report = lint_module.LintReport(min_sizes={"height": 2048, "width": 2048},
                                    below_minimum={"tried": [], "held": False, "failed": None,
                                                   "eager_fails": "2047x2047: AssertionError: "})
    assert report.serve_from == {} and "served as exported" in report.format()
