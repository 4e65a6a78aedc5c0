"""The torch.export-based exporter (export.exporter=dynamo) on the tiny TESTR-architecture spotter: a graph as
size- and batch-general as the TorchScript-based one's, verified. (A file of its own: its export alone takes over a
minute, and pytest-xdist's workers share out files. The gather sampler through torch.export: the DINO and
Mask2Former stand-ins, tests/test_dynamo_families.py and tests/test_dynamo_mask2former.py.)"""
import onnx

from exports import export


def test_auto_falls_back_to_torch_export_and_fused_is_one_node_per_attention(tmp_path, monkeypatch, caplog):
    """export.exporter=auto where the TorchScript exporter fails (as a torch without it would): the graph through
    torch.export, the manifest naming that route. With export.sampler=fused: d2export's custom op, translated to the
    same d2export-domain node the TorchScript route writes (one per MSDA module), verified on its kernel."""
    from d2export.exporting import onnx_export
    from d2export.kernels.custom_ops import FUSED_MSDA_ID

    real = onnx_export._run_exporter

    def no_torchscript(*args):
        if args[-1] == "torchscript":
            raise RuntimeError("this torch has no TorchScript-based ONNX exporter")
        return real(*args)

    monkeypatch.setattr(onnx_export, "_run_exporter", no_torchscript)
    manifest = export("textdet_tiny", tmp_path, "export.exporter=auto", "export.sampler=fused",
                      "verify.sizes=[[160,224],[224,160]]")  # the same token count transposed: nothing baked
    assert manifest.exporter == "dynamo" and "the torchscript exporter failed, trying dynamo" in caplog.text
    assert manifest.verification["passed"] is True and manifest.custom_ops == [FUSED_MSDA_ID]
    assert manifest.verification["lint"]["clean"] is True
    assert any(c["case"].startswith("batch ") for c in manifest.verification["cases"])
    model = onnx.load(str(tmp_path / "model.onnx"))
    assert manifest.opset == model.opset_import[0].version  # the graph's own opset, whatever was asked
    ours = [n for n in model.graph.node if n.domain == "d2export"]
    assert len(ours) == 3 and {n.op_type for n in ours} == {"MultiScaleDeformableAttention"}  # tiny: 3 modules


def test_auto_is_torchscript_where_that_exports(tmp_path):
    manifest = export("textdet_tiny", tmp_path, "export.exporter=auto", "export.lint=false",
                      "verify.sizes=[[224,160]]", "verify.batch=false")
    assert manifest.exporter == "torchscript" and manifest.verification["passed"] is True
