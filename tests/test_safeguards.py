"""Safeguards that must not switch off silently: below torch.export's minimums only the model's own size errors end
the walk; `export.lint=false` still checks below the minimums through torch.export; the lint's message names what
happened; a zoo patch keyed on a class path leaves a user's subclass override alone."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from d2export.exporting import lint as lint_module
from d2export.verification.float32 import check_below_minimums
from d2export.verification.size_refusals import model_size_error
from d2export.verification.subject import Subject
from d2export.patching import Target


# ------------------------------------------------------------------- below the minimums: whose error ends the walk
def _raising_subject(raise_it) -> Subject:
    """A subject whose eager reference raises at every size (before any graph is needed)."""
    adapter = SimpleNamespace(output_names=["out"], graph_inputs=lambda images: {}, reference=lambda images: raise_it())
    cfg = SimpleNamespace(export=SimpleNamespace(dummy_sizes=[[128, 160]]))
    return Subject(SimpleNamespace(cfg=cfg, adapter=adapter), None, [])


def model_assert():
    n, h, w = 10, 2, 4
    assert n == h * w  # ViTAEv2's ReductionCell: the model's own size assert


def model_topk():
    torch.ones(3).topk(5)  # torch's C++ error, at the model's call: "selected index k out of range"


def model_value_error():
    raise ValueError("picture too small for the stride-64 level")


def model_index_error():
    return torch.zeros(0)[0]  # an empty level indexed


def model_type_error():
    raise TypeError("forward() got an unexpected keyword argument 'sizes'")


def model_not_implemented():
    raise NotImplementedError("no CPU kernel")


def d2export_value_error():
    Target(runtime="openvino")  # a ValueError raised inside d2export's own code


@pytest.mark.parametrize("raise_it, kind", [(model_assert, "AssertionError"), (model_topk, "RuntimeError"),
                                            (model_value_error, "ValueError"), (model_index_error, "IndexError")])
def test_the_models_own_size_errors_end_the_walk(raise_it, kind):
    below = check_below_minimums(_raising_subject(raise_it), {"width": 101})
    assert below == {"tried": [], "held": False, "failed": None, "eager_fails": below["eager_fails"]}
    assert below["eager_fails"].startswith(f"128x100: {kind}: ")


@pytest.mark.parametrize("raise_it, kind", [(model_type_error, "TypeError"),
                                            (model_not_implemented, "NotImplementedError"),
                                            (d2export_value_error, "ValueError")])
def test_any_other_error_below_the_minimums_fails_with_its_message(raise_it, kind):
    with pytest.raises(RuntimeError, match=f"eager reference failed at 128x100: {kind}: .*not one of the model's own"
                                           ) as caught:
        check_below_minimums(_raising_subject(raise_it), {"width": 101})
    assert type(caught.value.__cause__).__name__ == kind


def test_the_rule_reads_the_innermost_frame():
    def caught(raise_it):
        try:
            raise_it()
        except Exception as e:  # noqa: BLE001
            return e

    assert model_size_error(caught(model_assert)) and model_size_error(caught(model_topk))
    assert not model_size_error(caught(d2export_value_error))  # d2export's frame, whoever called it
    assert not model_size_error(ValueError("never raised: no traceback"))


# ------------------------------------------------------------------------------ the lint says what it did, no None
def test_a_minimum_with_no_size_below_it_says_so():
    """A minimum of 8 px leaves no size of 8 px or more below it: nothing tried, and no eager failure to name."""
    below = check_below_minimums(_raising_subject(model_assert), {"width": 8})
    assert below == {"tried": [], "held": False, "failed": None, "eager_fails": None}
    text = lint_module.LintReport(min_sizes={"width": 8}, below_minimum=below).format()
    assert "None" not in text and "not tried below it (no size below it of 8 px or more)" in text
    failed = lint_module.LintReport(min_sizes={"width": 101}, below_minimum=check_below_minimums(
        _raising_subject(model_assert), {"width": 101})).format()
    assert "the model itself fails at 128x100: AssertionError" in failed


# --------------------------------------------------------------------- export.lint=false: the minimums still checked
class Branch(torch.nn.Module):  # a branch on a size: the graph keeps the dummy's side below width 101
    def forward(self, x):
        return x.sum(1) if x.shape[-1] > 100 else x.mean(1)


def test_lint_off_still_checks_below_torch_exports_minimums(tmp_path):
    """Through torch.export the minimums come with the capture: with export.lint=false the graph is still tried
    below them, and the runtime is told to pad smaller pictures where it answers differently there."""
    from d2export import pipeline
    from d2export.config import load
    from d2export.exporting.onnx_export import export_onnx

    axes = {"images": {0: "batch", 2: "height", 3: "width"}}
    result = export_onnx(Branch(), (torch.randn(2, 3, 128, 160),), tmp_path / "m.onnx", input_names=["images"],
                         output_names=["out"], dynamic_axes=axes, exporter="dynamo")
    cfg = load("textdet_tiny", [f"export.output_dir={tmp_path}", "export.dummy_sizes=[[128,160]]",
                                "export.lint=false"])
    adapter = SimpleNamespace(
        output_names=["out"], graph_inputs=lambda images: {"images": np.stack(images).astype(np.float32)},
        reference=lambda images: [Branch()(torch.from_numpy(np.stack(images).astype(np.float32))).numpy()])
    built = SimpleNamespace(cfg=cfg, adapter=adapter, family=SimpleNamespace(output_kinds={}, sorted_by=None))
    lint = pipeline._lint(built, result.path, result, axes)
    assert lint is not None and lint.min_sizes == {"width": 101}
    lint.below_minimum = check_below_minimums(Subject(built, result.path, []), lint.min_sizes)
    assert lint.below_minimum["failed"] == "128x100"
    assert pipeline._min_input_size(lint) == {"min_input_size": [0, 101]}  # the runtime pads up to it
    # TorchScript's lint is a second trace: off means off, and it has no minimums to check
    assert pipeline._lint(built, result.path, SimpleNamespace(size_assumptions=None), axes) is None


# ------------------------------------------------------------------- zoo patches and a user's subclass override
PATCH = "box-probabilities-for-torch-export"  # keyed on detectron2's FastRCNNOutputLayers.predict_probs


def _predictor_classes():
    from detectron2.modeling.roi_heads.fast_rcnn import FastRCNNOutputLayers

    class OwnProbs(FastRCNNOutputLayers):
        def predict_probs(self, predictions, proposals):  # the user's own rule: a temperature
            return (torch.softmax(predictions[0] / 2, dim=-1),)

    class Inherits(FastRCNNOutputLayers):
        pass

    return FastRCNNOutputLayers, OwnProbs, Inherits


def test_a_zoo_patch_leaves_a_subclass_override_alone_and_reaches_one_that_inherits(monkeypatch):
    from detectron2.layers import ShapeSpec
    from detectron2.modeling.box_regression import Box2BoxTransform
    from detectron2.structures import Boxes, Instances

    from d2export.patching import apply_patches

    base, own_cls, inherits_cls = _predictor_classes()
    make = lambda cls: cls(ShapeSpec(channels=8), box2box_transform=Box2BoxTransform((10, 10, 5, 5)),  # noqa: E731
                           num_classes=3).eval()
    own, inherits = make(own_cls), make(inherits_cls)
    model = torch.nn.ModuleDict({"own": own, "inherits": inherits})
    predictions = (torch.randn(4, 4), torch.randn(4, 12))
    proposals = [Instances((32, 32), proposal_boxes=Boxes(torch.rand(4, 4) * 16))]
    own_method, base_method = own_cls.__dict__["predict_probs"], base.__dict__["predict_probs"]
    want = own.predict_probs(predictions, proposals)[0]
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # the patch rewrites only while exporting
    with apply_patches(model, target=None, only=[PATCH]) as report:
        assert own_cls.__dict__["predict_probs"] is own_method and "predict_probs" not in vars(own)
        got = own.predict_probs(predictions, proposals)[0]
        assert report[PATCH].hits == 0
        assert "predict_probs" not in vars(inherits) and inherits_cls.predict_probs is not base_method
        inherited = inherits.predict_probs(predictions, proposals)[0]
        assert report[PATCH].hits == 1  # through the class it inherits from
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(inherited, torch.softmax(predictions[0], -1), rtol=0, atol=0)
    assert report[PATCH].sites == 1 and "OwnProbs" in report[PATCH].note
    assert base.__dict__["predict_probs"] is base_method  # restored
