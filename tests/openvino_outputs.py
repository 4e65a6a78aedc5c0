"""OpenVINO in the tests: its sessions made to return what a test says (wrong graphs whose verdicts depend on the
change made, not on a CPU's rounding), and what a manifest verified through it records."""
from d2export.runtime import openvino_session
from d2export.runtime.openvino_session import OpenVINOSession


def change_outputs(monkeypatch, change):
    """OpenVINO's sessions returning `change(output name, array)` of what they compute."""
    run = OpenVINOSession.run

    def changed(self, output_names, feeds):
        names = [a.name for a in self.get_outputs()] if output_names is None else list(output_names)
        return [change(n, v) for n, v in zip(names, run(self, output_names, feeds))]

    monkeypatch.setattr(OpenVINOSession, "run", changed)


def verified_through_openvino(manifest, precision: str, key: str, sampler: str, hint: str) -> dict:
    """`manifest`'s record `verification[key]`, after checking it was written as OpenVINO serves it: the float32 graph
    verified first (through onnxruntime), then `key` through OpenVINO's session at `hint`."""
    assert (manifest.precision, manifest.runtime, manifest.sampler) == (precision, "openvino", sampler)
    assert manifest.verification["passed"] is True  # the float32 graph first, through onnxruntime
    v = manifest.verification[key]
    assert v["passed"] is True and v["runtime"] == "openvino" and v["providers"] == [openvino_session.PROVIDER]
    assert v["provider_options"][openvino_session.PROVIDER]["INFERENCE_PRECISION_HINT"] == hint
    return v
