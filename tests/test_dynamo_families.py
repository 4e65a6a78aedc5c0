"""The torch.export route (export.exporter=dynamo) on the detrex family's stand-in: two-stage DINO (a LazyConfig,
detrex's own MSDA module, its query selection), verified with its config's own cases, a batch among them, as the
TorchScript route is. (TESTR: tests/test_dynamo_exporter.py; Mask2Former: tests/test_dynamo_mask2former.py; the
adet lineage's DPText-DETR and DeepSolo share TESTR's code paths and are checked by hand, docs/exporting.md.)"""
import onnx
import pytest

from exports import export


@pytest.mark.parametrize("config", ["dino_tiny"])
def test_the_family_exports_through_torch_export_verified(config, tmp_path):
    # the fused sampler (one custom node per attention; the gather sampler goes through torch.export in the
    # Mask2Former test): DINO's own code is the same either way, 78 -> 64 s here
    manifest = export(config, tmp_path, "export.exporter=dynamo", "export.sampler=fused")
    v = manifest.verification
    assert manifest.exporter == "dynamo" and v["passed"] is True
    # the lint, read off the capture: no level of a picture under 65 px is traced (its stride-64 level would be one
    # pixel), nor a batch of one (the dummy's is two; the single-picture cases verify it)
    assert v["lint"]["clean"] is True and v["lint"]["min_sizes"] == {"width": 65, "height": 65}
    assert v["lint"]["never_one"] == ["batch"]
    # ... which the graph does not need: below them it agrees with the model wherever the model itself runs (its
    # query selection takes more tokens than a 32x32 picture has), so the runtime takes any size
    assert v["lint"]["below_minimum"] == {"tried": ["64x64"], "held": True, "failed": None,
                                          "eager_fails": "32x32: RuntimeError: selected index k out of range"}
    assert v["lint"]["serve_from"] == {} and "min_input_size" not in manifest.preprocess
    cases = {c["case"] for c in v["cases"]}
    assert any(c.startswith("batch ") for c in cases) and len(cases) >= 3
    model = onnx.load(str(tmp_path / manifest.model_file))
    assert manifest.opset == model.opset_import[0].version >= 18  # what torch.export writes, recorded as written
