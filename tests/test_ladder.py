"""The parity ladder: planted faults in the exported graph only are named at the module that holds them; a clean
export shows no divergence at several sizes; the production export is unaffected by a ladder run."""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from d2export.verification import ladder
from d2export.verification.ladder import compare, default_rungs, flatten_tensors, module_of_node, run_ladder
from d2export.resizing import pad_batch
from d2export.tracing import dummy_images
from exports import export

SETTINGS = SimpleNamespace(exporter="torchscript", opset=17, dynamic=True)
THIS_FILE = str(Path(__file__).resolve())


@contextlib.contextmanager
def override_forward(module: nn.Module, make):
    """Within the block `module.forward` is `make(original_forward)`: a fault planted in the export scope only."""
    own = module.__dict__.get("forward")  # an instance-level forward already there (the MSDA swap)
    module.forward = make(module.forward)
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def combined(*scopes):
    @contextlib.contextmanager
    def scope():
        with contextlib.ExitStack() as stack:
            for s in scopes:
                stack.enter_context(s())
            yield

    return scope


# ---------------------------------------------------------------------------------------------- a toy "detector"
class Toy(nn.Module):
    """Graph inputs like the text spotter's; one stem, a head shared by three feature levels."""

    family = "toy"
    input_names = ("images", "image_sizes")
    output_names = ("out",)
    dynamic_axes = {"images": {0: "batch", 2: "height", 3: "width"}, "image_sizes": {0: "batch"}, "out": {0: "batch"}}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.ModuleList([nn.Conv2d(8, 8, 3, stride=2, padding=1) for _ in range(2)])
        self.head = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU())

    def graph_inputs(self, images):
        batch, sizes = pad_batch(images)
        return {"images": batch, "image_sizes": sizes}

    def forward(self, images, image_sizes):
        x = self.stem(images.float() / 255)
        levels = [x, self.down[0](x), self.down[1](self.down[0](x))]
        return torch.cat([self.head(f).mean((2, 3)) for f in levels], 1)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_shared_head_fault_is_named_by_call_order(exporter):
    toy = Toy().eval()
    settings = SimpleNamespace(exporter=exporter, opset=18, dynamic=True)

    def second_call_off(original):
        calls = iter(range(100))  # three calls per forward: the probe's, the trace's, …
        return lambda x: original(x) + (0.05 if next(calls) % 3 == 1 else 0.0)

    report = run_ladder(toy, settings, lambda: override_forward(toy.head, second_call_off),
                        dummy_images([(40, 56)]), {"56x40": dummy_images([(56, 40)], 5)})
    for case in report.cases:
        head_rows = [r for r in case.rows if r.module == "head"]
        assert [r.call for r in head_rows] == [0, 1, 2]
        assert [r.ok for r in head_rows] == [True, False, True]  # the third call has no fault planted
        assert case.first.module == "head" and case.first.call == 1
        assert 0.04 < case.first.max_abs < 0.06
        assert all(r.ok for r in case.rows[:case.rows.index(case.first)])
    culprit = report.culprit()
    assert (culprit.module, culprit.call) == ("head", 1)
    assert culprit.source.startswith(THIS_FILE)  # the forward that was traced: the planted one
    assert not culprit.new_at_size  # wrong at the export input already


def test_value_dependent_fault_is_not_blamed_on_a_baked_shape():
    toy = Toy().eval()

    def bright_images_off(original):  # wrong only where the picture is bright: values, not shapes
        return lambda x: original(x) + (x.mean() > 0.5).float() * 0.05

    dark, bright = (np.full((3, 40, 56), v, np.uint8) for v in (50, 200))
    report = run_ladder(toy, SETTINGS, lambda: override_forward(toy.stem, bright_images_off), [dark],
                        {"bright 40x56": [bright], "bright 56x40": [bright.transpose(0, 2, 1).copy()]})
    at_export, same_size, other_size = report.cases
    assert not at_export.diverged and same_size.first.module == "stem" and other_size.first.module == "stem"
    by_case = {c.case: c for c in report.culprits()}
    assert by_case["bright 40x56"].new_on_image and not by_case["bright 40x56"].new_at_size
    assert by_case["bright 56x40"].new_at_size and not by_case["bright 56x40"].new_on_image  # a size the export lacks
    assert "depends on values, not shapes" in report.format()


def test_clean_toy_has_no_divergence_and_leaves_no_hooks():
    toy = Toy().eval()
    report = run_ladder(toy, SETTINGS, ladder.no_scope, dummy_images([(40, 56)]),
                        {"33x71": dummy_images([(33, 71)], 1), "batch": dummy_images([(40, 56), (24, 30)], 2)})
    assert report.culprit() is None and len(report.cases) == 3
    modules = {r.module for r in report.cases[0].rows}
    assert modules == {"", "stem", "down.0", "down.1", "head", "head.0", "head.1"}
    assert all(not m._forward_hooks for m in toy.modules())
    assert "no module diverges" in report.format()


def test_default_rungs_pick_stages_layers_and_lists():
    toy = Toy()
    assert default_rungs(toy, depth=1) == ["", "stem", "down.0", "down.1", "head"]
    assert "head.0" in default_rungs(toy, depth=2)


def test_compare_finds_the_first_bad_element():
    e = np.zeros((2, 3, 4), np.float32)
    a = e.copy()
    a[1, 2, 0] = 0.5
    a[1, 2, 3] = 0.7
    max_abs, _, first, ok = compare(e, a, 1e-3, 1e-3)
    assert (max_abs, first, ok) == (pytest.approx(0.7), [1, 2, 0], False)
    big = np.full((3,), 1e4, np.float32)
    assert compare(big, big + 5, 1e-3, 1e-3)[3] is True  # within rtol of a large value
    inf = np.array([np.inf, -np.inf, np.nan, 1.0])
    assert compare(inf, inf.copy(), 1e-3, 1e-3)[:2] == (0.0, 0.0)
    assert compare(inf, np.array([np.inf, 5.0, np.nan, 1.0]), 1e-3, 1e-3)[2] == [1]
    assert compare(e, e[:1], 1e-3, 1e-3)[3] is False
    ids = np.arange(2000)
    flipped = ids.copy()
    flipped[7] = 0
    assert compare(ids, flipped, 0, 0, max_mismatch=1e-3)[3] is True
    assert compare(ids, flipped, 0, 0, max_mismatch=0.0)[3] is False


def test_flatten_and_node_names():
    t = torch.ones(1)
    nested = (t, {"a": [t, None, 3]}, SimpleNamespace(tensors=t, mask=t, name="x"))
    assert [w for w, _ in flatten_tensors(nested)] == ["[0]", "[1]['a'][0]", "[2].tensors", "[2].mask"]
    msg = "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while running Reshape node. " \
          "Name:'/adapter/head/head.0/Reshape_2' Status Message: cannot reshape"
    assert module_of_node(msg) == "adapter.head.head.0"
    toy = Toy()
    toy.alias = toy.head  # scope names follow the attribute a module was called through
    assert module_of_node(msg.replace("/head/head.0/", "/alias/0/"), toy) == "head.0"
    assert module_of_node(msg.replace("/head/head.0/", "/down.1/"), toy) == "down.1"
    assert module_of_node("Name:'node_Add_12'") is None


# ---------------------------------------------------------------------------------- the TESTR-architecture model
@pytest.fixture(scope="module")
def tiny():
    from d2export import pipeline
    from d2export.config import load

    return pipeline.prepare(load("textdet_tiny", ["export.output_dir=unused"]))


def scope_of(built, *extra):
    from d2export import pipeline

    return combined(lambda: pipeline.export_scope(built), *extra)


def test_clean_export_has_no_divergence_at_several_sizes(tiny):
    from d2export.pipeline import ladder as ladder_for

    report = ladder_for(tiny, [(160, 224), (224, 160), (128, 288), (173, 217)])
    assert report.culprit() is None, report.format()
    rows = report.cases[1].rows
    assert len(report.cases) == 5 and all(c.rows and not c.error for c in report.cases)
    modules = [r.module for r in rows]
    for path in ("model.testr.backbone.0.backbone.res3", "model.testr.input_proj.3",
                 "model.testr.transformer.encoder.layers.0", "model.testr.transformer.encoder.layers.0.self_attn",
                 "model.testr.transformer.decoder.layers.0.attn_cross_text", "model.testr.text_class", ""):
        assert path in modules, path
    # completion order: an attention finishes before its layer, the layer before the encoder
    assert modules.index("model.testr.transformer.encoder.layers.0.self_attn") < modules.index(
        "model.testr.transformer.encoder.layers.0") < modules.index("model.testr.transformer.encoder")
    assert max(r.max_abs for r in rows) > 0  # the two sides are computed independently


def test_perturbed_attention_in_the_graph_only_is_named_first(tiny):
    attn = tiny.model.get_submodule("testr.transformer.decoder.layers.0.attn_cross_text")
    sizes = dummy_images([(160, 224)])
    perturb = lambda original: lambda *a, **k: original(*a, **k) + 0.02  # noqa: E731
    report = run_ladder(tiny.adapter, tiny.cfg.export, scope_of(tiny, lambda: override_forward(attn, perturb)),
                        sizes, {"128x288": dummy_images([(128, 288)], 3)})
    for case in report.cases:
        assert case.first.module == "model.testr.transformer.decoder.layers.0.attn_cross_text", report.format()
        assert case.first.max_abs == pytest.approx(0.02, rel=0.05)
        before = case.rows[:case.rows.index(case.first)]
        assert "model.testr.transformer.decoder.layers.0.attn_cross" in {r.module for r in before}
        assert all(r.ok for r in before)
    culprit = report.culprit()
    assert culprit.source.startswith(THIS_FILE)  # the planted forward …
    assert culprit.model_source.endswith(tuple(f"msda_swap.py:{i}" for i in range(200)))  # … not the model's own


def baked_layout(original):
    """Value-preserving at the traced size, but the traced view bakes that size's height and width in: at a size
    with the same number of cells laid out otherwise it silently scrambles the map; at any other it fails."""

    def forward(x):
        y = original(x)
        n, c = y.shape[:2]
        h, w = int(y.shape[2]), int(y.shape[3])  # Python ints: constants in the trace (TracerWarnings)
        z = y.transpose(2, 3).contiguous().view(n, c, w, h).transpose(2, 3)
        return z.reshape(y.shape)

    return forward


def test_baked_shape_is_found_at_another_size_not_at_the_export_size(tiny):
    proj = tiny.model.get_submodule("testr.input_proj.1")
    report = run_ladder(tiny.adapter, tiny.cfg.export, scope_of(tiny, lambda: override_forward(proj, baked_layout)),
                        dummy_images([(160, 224)]), {"224x160": dummy_images([(224, 160)], 3),
                                                     "192x224": dummy_images([(192, 224)], 4)})
    at_export, transposed, other = report.cases
    assert not at_export.diverged, report.format()
    assert transposed.first.module == "model.testr.input_proj.1", report.format()
    assert all(r.ok for r in transposed.rows[:transposed.rows.index(transposed.first)])
    assert other.error and other.error_module == "model.testr.input_proj.1", other.error
    culprits = report.culprits()
    assert [c.case for c in culprits] == ["224x160", "192x224"]
    assert [c.failed for c in culprits] == [False, True]
    assert all(c.new_at_size and c.module == "model.testr.input_proj.1" for c in culprits)
    assert any(w.startswith(THIS_FILE) for w in culprits[0].tracer_warnings), culprits[0].tracer_warnings
    text = report.format()
    assert "baked" in text and "model.testr.input_proj.1" in text


def test_production_export_is_byte_identical_with_and_without_a_ladder_run(tiny_export, tmp_path):
    from d2export import pipeline
    from d2export.config import load
    from d2export.pipeline import ladder as ladder_for

    _, _, model_path = tiny_export
    before = model_path.read_bytes()
    quiet = tmp_path / "ladder"
    quiet.mkdir()
    built = pipeline.prepare(load("textdet_tiny", [f"export.output_dir={quiet}"]))  # the fixture's model
    assert ladder_for(built, [(224, 160)]).culprit() is None
    assert all(not m._forward_hooks for m in built.adapter.modules())
    assert not list(quiet.iterdir())  # the ladder wrote nothing in the output folder
    again = export("textdet_tiny", tmp_path, "export.lint=false", "verify.enabled=false")  # neither touches the file
    assert (tmp_path / again.model_file).read_bytes() == before


def test_diagnose_command_on_a_plain_rcnn(capsys):
    from d2export.cli import main

    assert main(["diagnose", "--config", "rcnn", "--sizes", "256x320", "export.lint=false"]) == 0
    out = capsys.readouterr().out
    assert "no module diverges" in out
    for path in ("model.backbone.bottom_up.res4", "model.proposal_generator", "model.roi_heads.box_predictor"):
        assert path in out, path


def test_a_ladder_that_crashes_is_an_error_beside_the_verifications_verdict(monkeypatch, caplog):
    """The ladder is a diagnosis run when verification fails: where it crashes (through torch.export a patch may
    turn a module's tensors into Python sizes), that is an error in the report, never a clean ladder, and the
    refusal keeps its own figures."""
    from d2export.verification import float32
    from d2export.verification.subject import Subject

    def broken(built, route=None):
        raise RuntimeError("the traced run did not call what the eager probe did")

    monkeypatch.setattr(ladder, "ladder", broken)
    with caplog.at_level("WARNING", logger="d2export"):
        summary = ladder._ladder_summary(Subject(None, None, [], "torchscript"))
    assert summary["culprit"] is None and summary["diverged"] is None and "did not call" in summary["error"]
    assert float32._culprit_line(summary) == (
        "\nthe parity ladder crashed (no module compared): RuntimeError: the traced run did not call what the eager "
        "probe did")
    said = [r for r in caplog.records if "parity ladder" in r.getMessage()]
    assert [r.levelname for r in said] == ["ERROR"] and "crashed" in said[0].getMessage()


class LevelSizes(nn.Module):
    """As `level-sizes-for-torch-export` does: eagerly a tensor of sizes, under torch.export the sizes as Python
    values (symbolic ints), which no graph output can hold."""

    def forward(self, x):
        if torch.compiler.is_exporting():
            return [tuple(x.shape[-2:])]
        return torch.tensor([list(x.shape[-2:])])


class ToyWithSizes(Toy):
    def __init__(self):
        super().__init__()
        self.sizes = LevelSizes()

    def forward(self, images, image_sizes):
        self.sizes(images)
        return super().forward(images, image_sizes)


def test_through_torch_export_a_rung_that_becomes_python_sizes_is_passed_over_and_a_fault_still_named():
    toy = ToyWithSizes().eval()
    settings = SimpleNamespace(exporter="dynamo", opset=18, dynamic=True)

    def second_call_off(original):
        calls = iter(range(100))
        return lambda x: original(x) + (0.05 if next(calls) % 3 == 1 else 0.0)

    report = run_ladder(toy, settings, lambda: override_forward(toy.head, second_call_off),
                        dummy_images([(40, 56)]), {"56x40": dummy_images([(56, 40)], 5)})
    for case in report.cases:
        sizes = [r for r in case.rows if r.module == "sizes"]
        assert [(r.reached, r.ok, r.note) for r in sizes] == [(False, False, "Python values in the traced program")]
        assert (case.first.module, case.first.call) == ("head", 1)


class Repeats(Toy):
    """The head applied once per 32 px of width: TorchScript's trace unrolls the traced count of calls."""

    def forward(self, images, image_sizes):
        x = self.stem(images.float() / 255)
        for _ in range(images.shape[-1] // 32):
            x = x + self.head(x).mean(1, keepdim=True)
        return x.mean((2, 3))


def test_a_rung_the_graph_never_reached_is_shown_not_reached_not_ok():
    """At a wider picture eager calls the head twice, the graph (traced at one call) once: the second call has no
    tensor in the graph, so it is reported "not reached" (neither ok nor the graph's divergence), plainly."""
    toy = Repeats().eval()
    report = run_ladder(toy, SETTINGS, ladder.no_scope, dummy_images([(40, 56)]),
                        {"40x70": dummy_images([(40, 70)], 5)})
    at_export, wider = report.cases
    assert not at_export.not_reached and not at_export.diverged
    missed = [r for r in wider.rows if not r.reached]
    assert [(r.module, r.call, r.ok, r.note) for r in missed] == [
        (m, 1, False, "not in the graph") for m in ("head.0", "head.1", "head")]  # child before parent
    assert wider.first is not None and wider.first.reached  # what diverged is a compared rung: the outputs
    text = report.format(all_rows=True)
    assert "== 40x70: DIVERGES, 3 rung(s) not reached" in text
    assert any(line.startswith("head #1") and "not reached" in line for line in text.splitlines())
    assert report.to_dict()["cases"][1]["not_reached"] == ["head.0 #1", "head.1 #1", "head #1"]
