"""export.runtime=openvino with export.int8: the QDQ graph served by OpenVINO (its quantised products in int8, the rest
in float32), verified as served, tensors and accuracy alike; the refusals, each in one line.

The wrong graphs here are OpenVINO's outputs changed by hand, so the verdicts depend on the change and not on a CPU's
int8 rounding; that they are refused proves the checks ran through OpenVINO, not onnxruntime."""
from collections import Counter

import numpy as np
import pytest

from d2export.config import ConfigError, load
from d2export.runtime import openvino_session
from d2export.runtime.openvino_session import OpenVINOSession
from exports import export
from openvino_outputs import change_outputs, verified_through_openvino

STATIC = ("export.int8=static", "export.sampler=fused", "export.runtime=openvino", "export.calibration_count=8",
          "verify.batch=false", "export.lint=false")


@pytest.mark.parametrize("overrides, says", [
    (["export.runtime=openvino"], "serves int8 and bfloat16 graphs .*a float32 graph is served by onnxruntime"),
    (["export.runtime=openvino", "export.fp16=true"], "a float16 graph is served by onnxruntime"),
    (["export.runtime=tensorrt"], "export.runtime"),
    (["export.bf16=true", "export.runtime=onnxruntime"], "no bfloat16 GEMM, OpenVINO serves bfloat16"),
    (["export.int8=dynamic", "export.runtime=openvino", "export.sampler=trt_plugin"],
     "export.runtime=openvino with export.sampler=trt_plugin: OpenVINO cannot load that operator"),
])
def test_runtime_settings_are_checked_up_front(overrides, says):
    with pytest.raises(ConfigError, match=says) as refused:
        load("textdet_tiny", overrides + ["export.output_dir=/nonexistent"])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("precision", [["export.int8=dynamic", "export.runtime=openvino"], ["export.bf16=true"]])
def test_a_graph_verified_through_openvino_needs_it_installed_and_says_so_up_front(precision, monkeypatch):
    from d2export import config, cpu

    monkeypatch.setattr(config, "_openvino_installed", lambda: False)
    monkeypatch.setattr(cpu, "cpu_features", lambda: ["avx2", "avx512_bf16"])  # bf16's own check passes
    with pytest.raises(ConfigError, match=r"needs the openvino package: pip install 'd2export\[openvino\]'") as no:
        load("textdet_tiny", precision + ["export.output_dir=/nonexistent"])
    assert "\n" not in str(no.value)
    assert load("textdet_tiny", precision + ["export.output_dir=/nonexistent", "verify.enabled=false"])


@pytest.fixture(scope="module")
def openvino_int8(text_pictures, tmp_path_factory):
    out = tmp_path_factory.mktemp("openvino_int8")
    manifest = export("textdet_micro", out, *STATIC, f"export.calibration={text_pictures}")
    return manifest, out / manifest.model_file


def test_an_int8_export_verifies_as_openvino_serves_it_and_the_predictor_serves_it_so(openvino_int8):
    import onnx

    from d2export.runtime.predictor import Predictor
    from d2export.runtime.providers import ProviderUnavailable

    manifest, path = openvino_int8
    v = verified_through_openvino(manifest, "int8", "int8", "fused", "f32")
    assert v["quantization"]["mode"] == "static" and v["quantization"]["quantized"] > 20
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(path)).graph.node)
    predictor = Predictor(path, threads=1)
    assert isinstance(predictor.session, OpenVINOSession) and predictor.session.precision == "f32"
    assert predictor.metadata()["providers"] == [openvino_session.PROVIDER]
    with pytest.raises(ProviderUnavailable, match="its int8 graph is served by OpenVINO on the CPU") as refused:
        Predictor(path, providers=["cuda"])
    assert "\n" not in str(refused.value)


def test_words_openvino_serves_are_those_onnxruntime_serves_from_the_same_int8_graph(openvino_int8, labelled_text):
    """What users receive: the words of 12 held-out pictures, OpenVINO against onnxruntime on the same graph (the
    manifest's runtime rewritten), as a multiset F-measure: the trained spotter's words hold through either runtime's
    int8 rounding (seen on the AMX Xeon: one duplicate word more of 49)."""
    import dataclasses
    import shutil

    from PIL import Image

    from d2export.runtime.predictor import Predictor

    manifest, path = openvino_int8
    both = {}
    for runtime in ("openvino", "onnxruntime"):
        folder = path.parent / f"served_by_{runtime}"
        folder.mkdir(exist_ok=True)
        shutil.copy(path, folder / path.name)
        dataclasses.replace(manifest, runtime=runtime).write(folder / path.with_suffix(".manifest.json").name)
        predictor = Predictor(folder / path.name, threads=1)
        both[runtime] = [sorted(i.text for i in predictor.predict(np.asarray(Image.open(p).convert("RGB"))).instances)
                         for p in sorted((labelled_text / "images").iterdir())]
    shown = [sum(len(w) for w in both[r]) for r in both]
    same = sum(sum((Counter(a) & Counter(b)).values()) for a, b in zip(both["openvino"], both["onnxruntime"]))
    assert min(shown) >= 12 and 2 * same >= 0.9 * sum(shown), (same, shown)  # F-measure of the words shown


def test_a_wrong_graph_is_refused_by_int8_tensor_verification_through_openvino(text_pictures, tmp_path, monkeypatch):
    """Every score OpenVINO computes raised by 0.3: int8's verification refuses it (onnxruntime would have passed
    it), and nothing is written."""
    from d2export.verification.comparison import VerificationError

    change_outputs(monkeypatch, lambda name, v: v + 0.3 if name == "scores" else v)
    with pytest.raises(VerificationError, match=r"(?s)the int8 graph disagrees with eager PyTorch.*\n\S+ +scores .*NO"):
        export("textdet_micro", tmp_path, *STATIC, f"export.calibration={text_pictures}")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))


def test_int8_held_to_accuracy_serves_through_openvino(text_pictures, labelled_text, tmp_path, monkeypatch):
    """Every character OpenVINO reads one off: the words served are wrong, accuracy refuses it (end-to-end H-mean),
    and nothing is written."""
    from d2export.verification.held_out_accuracy import AccuracyError

    change_outputs(monkeypatch, lambda name, v: v + 1 if name == "char_ids" else v)
    with pytest.raises(AccuracyError, match=r"text/e2e_hmean dropped more than verify.int8_max_drop=1 point"):
        export("textdet_micro", tmp_path, *STATIC, f"export.calibration={text_pictures}",
               f"verify.int8_accuracy={labelled_text}")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))


def test_d2export_evaluate_serves_int8_openvino_through_openvino(text_pictures, labelled_text):
    """`d2export evaluate --precision int8-openvino`: the graph is exported for OpenVINO and served by it, and the
    report says so."""
    from d2export.evaluating.evaluate import evaluate

    report = evaluate([], dataset=str(labelled_text), config="textdet_micro", precisions=["int8-openvino"], threads=1,
                      overrides=["export.sampler=fused", f"export.calibration={text_pictures}",
                                 "export.calibration_count=8", "verify.batch=false", "export.lint=false"])
    pytorch, served = report["runs"]
    assert (served["name"], served["precision"], served["runtime"]) == ("int8-openvino", "int8", "openvino")
    assert served["metrics"]["text/e2e_hmean"] > 0 and pytorch["runtime"] == ""
