"""export.bf16: the float32 graph served in bfloat16 by OpenVINO (d2export/runtime/openvino_session.py), verified as
served (d2export/verification/bfloat16.py), the Predictor opening it so, and the refusals, each in one line.

The tests that serve in bfloat16 need a CPU with AVX512-BF16 or AMX-BF16 (`NEEDS_BF16`: skipped elsewhere, saying
so); the refusals and the OpenVINO float32 session run on any CPU."""
import dataclasses
import shutil
import subprocess
import sys

import numpy as np
import pytest

from d2export import cpu
from d2export.config import ConfigError, load
from d2export.runtime import openvino_session
from d2export.runtime.openvino_session import Bf16Unavailable, OpenVINOSession, bf16_supported
from exports import export
from openvino_outputs import change_outputs, verified_through_openvino

NEEDS_BF16 = pytest.mark.skipif(not bf16_supported(), reason="serving in bfloat16 needs a CPU with AVX512-BF16 or "
                                f"AMX-BF16 (this one: {cpu.describe_cpu()})")
NO_BF16 = ["avx2", "avx512f", "avx512_vnni"]  # an AVX-512 CPU without bfloat16 (Skylake-SP, Ice Lake)


def _picture(seed: int = 5, size=(160, 224)) -> np.ndarray:
    """A picture with strokes and bars: something for the spotter's proposals to pick between."""
    rng = np.random.default_rng(seed)
    picture = np.full((*size, 3), 200, np.uint8)
    for _ in range(12):
        y, x = rng.integers(0, size[0] - 20), rng.integers(0, size[1] - 40)
        picture[y:y + rng.integers(4, 20), x:x + rng.integers(10, 40)] = rng.integers(0, 120, 3)
    return picture


def test_bf16_supported_reads_the_cpu_features():
    assert bf16_supported(["avx2", "avx512f", "avx512_bf16"]) and bf16_supported(["avx2", "amx_tile", "amx_bf16"])
    assert not bf16_supported(NO_BF16) and not bf16_supported([])


@pytest.mark.parametrize("overrides, says", [
    (["export.bf16=true", "export.sampler=trt_plugin"], "OpenVINO cannot load that operator; use "
                                                       "export.sampler=fused"),
    (["export.bf16=true", "export.fp16=true"], "one precision"),
    (["export.bf16=true", "export.int8=dynamic"], "one precision"),
    (["verify.bf16_accuracy=held"], "verify.bf16_accuracy judges a bfloat16 graph: set export.bf16=true"),
    (["export.bf16=true", "verify.bf16_accuracy=held", "verify.bf16_max_drop=-1"], "bf16_max_drop"),
])
def test_bf16_settings_are_checked_up_front(overrides, says, monkeypatch):
    monkeypatch.setattr(cpu, "cpu_features", lambda: ["avx2", "avx512f", "avx512_bf16"])  # the settings, on any CPU
    with pytest.raises(ConfigError, match=says) as refused:
        load("textdet_tiny", overrides + ["export.output_dir=/nonexistent"])
    assert "\n" not in str(refused.value)


def test_an_export_in_bf16_is_refused_on_a_cpu_without_it(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_features", lambda: list(NO_BF16))
    with pytest.raises(ConfigError, match="needs a CPU with AVX512-BF16 or AMX-BF16 .*leave export.bf16 off") as no:
        load("textdet_tiny", ["export.bf16=true", "export.output_dir=/nonexistent"])
    assert "\n" not in str(no.value)
    assert load("textdet_tiny", ["export.output_dir=/nonexistent"]).export.bf16 is False  # float32 is not refused


@pytest.fixture(scope="module")
def as_bf16(tiny_export, tmp_path_factory):
    """The tiny spotter's verified float32 graph with a manifest saying bfloat16 served by OpenVINO, as export.bf16
    writes it (the graph is the same float32 graph; only the manifest differs): (manifest, model path)."""
    _, manifest, path = tiny_export
    out = tmp_path_factory.mktemp("as_bf16")
    shutil.copy(path, out / path.name)
    manifest = dataclasses.replace(manifest, precision="bfloat16", runtime="openvino")
    manifest.write(out / path.with_suffix(".manifest.json").name)
    return manifest, out / path.name


def test_the_predictor_refuses_a_bf16_graph_in_one_line_on_a_cpu_without_bf16(as_bf16, monkeypatch):
    from d2export.runtime.predictor import Predictor
    from d2export.runtime.providers import ProviderUnavailable

    _, path = as_bf16
    monkeypatch.setattr(cpu, "cpu_features", lambda: list(NO_BF16))
    with pytest.raises(Bf16Unavailable, match="needs a CPU with AVX512-BF16 or AMX-BF16 .*export float32") as no:
        Predictor(path)
    assert "\n" not in str(no.value) and isinstance(no.value, ProviderUnavailable)  # infer and serve: one line
    with pytest.raises(ProviderUnavailable, match="served by OpenVINO on the CPU"):
        Predictor(path, providers=["cuda"])


def test_openvino_in_float32_serves_what_onnxruntime_does(tiny_export):
    """The same graph, the same feeds: OpenVINO's float32 within float32 verification's tolerances of onnxruntime's
    (verify.atol, rtol, pixel_atol: 1e-3), ids equal; inputs and outputs as onnxruntime shows them."""
    import onnxruntime as ort

    from d2export.runtime.model_loading import check_schema
    from d2export.runtime.processing import Processing

    _, manifest, path = tiny_export
    ours, theirs = OpenVINOSession(path, "f32", threads=1), ort.InferenceSession(str(path),
                                                                                  providers=["CPUExecutionProvider"])
    for a, b in ((ours.get_inputs(), theirs.get_inputs()), (ours.get_outputs(), theirs.get_outputs())):
        assert [(x.name, x.type, len(x.shape)) for x in a] == [(x.name, x.type, len(x.shape)) for x in b]
    check_schema(path, manifest, ours)
    processing = Processing(manifest)
    feeds = processing.feeds([processing.prepare(_picture(seed), "RGB") for seed in (5, 6)])  # a batch of two
    names = [o.name for o in theirs.get_outputs()]
    expected = dict(zip(names, theirs.run(names, feeds)))
    got = dict(zip(names[::-1], ours.run(names[::-1], feeds)))  # in the order asked for
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got[name], want, atol=1e-3, rtol=1e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert ours.get_provider_options()[openvino_session.PROVIDER]["INFERENCE_PRECISION_HINT"] == "f32"


def test_the_runtime_still_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['detectron2'] = None; "
            "import d2export.runtime.openvino_session, d2export.runtime.predictor")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory):
    """textdet_tiny exported with export.bf16=true (verified as OpenVINO serves it in bfloat16)."""
    out = tmp_path_factory.mktemp("bf16")
    manifest = export("textdet_tiny", out, "export.bf16=true", "export.lint=false")
    return manifest, out / manifest.model_file


@NEEDS_BF16
def test_a_bf16_export_verifies_as_served_and_the_predictor_serves_it_in_bf16(bf16_export):
    from d2export.runtime.predictor import Predictor

    manifest, path = bf16_export
    v = verified_through_openvino(manifest, "bfloat16", "bf16", "gather", "bf16")
    assert v["tolerances"]["probabilities"] == {"atol": 0.05, "rtol": 0.05} and v["tolerances"]["ids"]["atol"] == 0
    predictor = Predictor(path, threads=1)
    assert isinstance(predictor.session, OpenVINOSession) and predictor.session.precision == "bf16"
    assert predictor.metadata()["providers"] == [openvino_session.PROVIDER]
    found = predictor.predict(_picture())
    assert found.instances and all(i.text is not None and len(i.polygon) for i in found.instances)


@NEEDS_BF16
def test_a_wrong_graph_is_refused_by_the_bf16_verification(tmp_path, monkeypatch):
    """Every score of the graph raised by 0.3 after its float32 verification: the bfloat16 verification refuses it
    (0.05 + 0.05·|x|; no detection may come and go at the list's cut by more than that), and nothing is written.
    (Scores, not coordinates: the tiny spotter's seeded weights score every detection alike, near the list's cut,
    where a detection's other outputs may change with the noise the score tolerance allows.)"""
    import onnx
    from onnx import helper, numpy_helper

    from d2export.verification import bfloat16
    from d2export.verification.comparison import VerificationError

    real = bfloat16.verify_bfloat16

    def moved_then_verified(subject):
        model = onnx.load(str(subject.path))
        producer = next(n for n in model.graph.node if "scores" in n.output)
        producer.output[list(producer.output).index("scores")] = "scores_right"
        model.graph.initializer.append(numpy_helper.from_array(np.float32(0.3), "more"))
        model.graph.node.append(helper.make_node("Add", ["scores_right", "more"], ["scores"]))
        onnx.save(model, str(subject.path))
        return real(subject)

    monkeypatch.setattr(bfloat16, "verify_bfloat16", moved_then_verified)
    with pytest.raises(VerificationError, match=r"(?s)the bfloat16 graph disagrees with eager PyTorch.*\n\S+ +scores .*NO"):
        export("textdet_tiny", tmp_path, "export.bf16=true", "export.lint=false", "verify.batch=false")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))


@NEEDS_BF16
def test_a_fused_bf16_export_verifies_and_serves_through_the_extension(tmp_path):
    """export.sampler=fused in bfloat16: OpenVINO runs d2export's operator (its extension), the export verifies as
    served, and the Predictor serves words from it."""
    from d2export.runtime.predictor import Predictor

    manifest = export("textdet_tiny", tmp_path, "export.bf16=true", "export.sampler=fused", "export.lint=false")
    assert (manifest.precision, manifest.runtime, manifest.sampler) == ("bfloat16", "openvino", "fused")
    assert manifest.custom_ops == ["d2export.MultiScaleDeformableAttention"]
    assert manifest.verification["bf16"]["passed"] is True
    predictor = Predictor(tmp_path / manifest.model_file, threads=1)
    assert predictor.session.precision == "bf16"
    found = predictor.predict(_picture())
    assert found.instances and all(i.text is not None and len(i.polygon) for i in found.instances)


def test_triton_repo_refuses_a_graph_openvino_serves(as_bf16, tmp_path):
    """Triton's onnxruntime backend would serve the bfloat16 graph in float32, unverified as such: refused, nothing
    written."""
    from d2export.runtime.triton import write_repository

    _, path = as_bf16
    with pytest.raises(ValueError, match="bfloat16 graph served by openvino"):
        write_repository(path, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def _served_changed(monkeypatch, change):
    """OpenVINO's "bfloat16" sessions computing in float32 with `change(name, array)` applied to what they return:
    what the judgement must say then depends on the change, not on a CPU's bfloat16 rounding (and runs on any CPU)."""
    monkeypatch.setattr(openvino_session, "require_bf16", lambda *a, **k: None)
    for name in ("bf16", "bfloat16"):
        monkeypatch.setitem(openvino_session.PRECISIONS, name, "f32")
    change_outputs(monkeypatch, change)


def test_bf16_held_to_accuracy_writes_a_graph_whose_unserved_scores_moved(labelled_text, tmp_path, monkeypatch):
    """Scores under 0.3 halved as served (past verify.bf16_*'s 0.05 + 0.05·|x|; all under the micro spotter's 0.4
    display threshold): the tensors refuse, recorded; the words served are float32's, so accuracy holds."""
    _served_changed(monkeypatch, lambda name, v: np.where(v < 0.3, v * 0.5, v) if name == "scores" else v)
    manifest = export("textdet_micro", tmp_path, "export.bf16=true", "export.sampler=fused",
                      f"verify.bf16_accuracy={labelled_text}", "verify.batch=false", "verify.pin_selections=false",
                      "export.lint=false")
    v = manifest.verification["bf16"]
    assert manifest.precision == "bfloat16" and v["passed"] is True and v["judged_by"] == "accuracy"
    assert v["tensors"]["passed"] is False and "disagrees with eager PyTorch" in v["tensors"]["refusal"]
    a = v["accuracy"]
    assert a["pictures"] == 12 and a["evaluator"] == "text" and a["max_drop"] == 1.0
    assert set(a["metrics"]) == {"text/det_hmean", "text/e2e_hmean"}
    for row in a["metrics"].values():
        assert row["float32"] > 0 and abs(row["drop"]) < 1e-6
    assert (tmp_path / manifest.model_file).is_file()


def test_bf16_that_misreads_every_word_is_refused_by_accuracy_and_nothing_is_written(labelled_text, tmp_path,
                                                                                     monkeypatch):
    from d2export.verification.held_out_accuracy import AccuracyError

    _served_changed(monkeypatch, lambda name, v: v + 1 if name == "char_ids" else v)
    with pytest.raises(AccuracyError, match=r"text/e2e_hmean dropped more than verify.bf16_max_drop=1 point"):
        export("textdet_micro", tmp_path, "export.bf16=true", "export.sampler=fused",
               f"verify.bf16_accuracy={labelled_text}", "verify.batch=false", "export.lint=false")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))
