"""The torch.export-based exporter (export.exporter=dynamo) on the tiny TESTR-architecture spotter: a graph as
size- and batch-general as the TorchScript-based one's, verified. (A file of its own: its export alone takes over a
minute, and pytest-xdist's workers share out files.)"""
import onnx

from exports import export


def test_torch_export_based_exporter_is_size_and_batch_general(tmp_path):
    manifest = export("textdet_tiny", tmp_path, "export.exporter=dynamo", "export.lint=false",
                      "verify.sizes=[[160,224],[224,160]]")
    v = manifest.verification
    assert v["passed"] is True and any(c["case"].startswith("batch ") for c in v["cases"])
    model = onnx.load(str(tmp_path / "model.onnx"))
    assert manifest.opset == model.opset_import[0].version  # the graph's own opset, whatever was asked
    assert "GridSample" not in {n.op_type for n in model.graph.node}
