"""export.device: where the model is built, traced and its references computed (auto: CUDA where torch sees one),
with TF32 off while they are. The graph must not depend on it: the CUDA test runs where a GPU is present."""
import onnx
import pytest
import torch

from d2export import building
from d2export.config import ConfigError, UserError, load


def test_device_names_are_checked_before_anything_is_built():
    for bad in ("gpu", "cuda:x", "CPU"):
        with pytest.raises(ConfigError, match=f"export.device='{bad}': choose auto, cpu, cuda or cuda:N"):
            load("textdet_tiny", ["export.output_dir=unused", f"export.device={bad}"])
    assert load("textdet_tiny", ["export.output_dir=unused"]).export.device == "auto"


def test_auto_is_cuda_only_where_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert building.resolve_device("auto") == "cpu" and building.resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match="export.device=cuda: torch .* sees 0 CUDA device"):
        building.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert building.resolve_device("auto") == "cuda" and building.resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(UserError, match="export.device=cuda:1: .* sees 1 CUDA device"):
        building.resolve_device("cuda:1")


def test_tf32_is_off_inside_and_restored_after():
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    saved = flags()
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with pytest.raises(RuntimeError, match="inside"):
            with building.exact_float32():
                assert flags() == (False, False)
                raise RuntimeError("inside")
        assert flags() == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the graph is compared with the CPU's)")
def test_a_cuda_export_is_the_cpu_graph(tmp_path):
    from d2export import pipeline

    graphs = {}
    for device in ("cpu", "cuda"):
        cfg = load("textdet_tiny", [f"export.output_dir={tmp_path / device}", f"export.device={device}"])
        manifest = pipeline.export(cfg)
        assert manifest.verification["passed"] is True and manifest.verification["device"] == device
        graphs[device] = onnx.load(str(tmp_path / device / manifest.model_file)).graph
    assert [n.op_type for n in graphs["cuda"].node] == [n.op_type for n in graphs["cpu"].node]
    assert not any("cuda" in str(a).lower() for n in graphs["cuda"].node for a in n.attribute)


def test_evaluate_runs_the_pytorch_column_without_tf32(monkeypatch):
    """The column every graph is compared with is float32 on CUDA too (cuDNN's TF32 default moved 52 of 300 box
    fixture pictures on an H200), and the user's setting is back afterwards."""
    import detectron2.evaluation
    from detectron2.evaluation import DatasetEvaluator

    from d2export.evaluating import runs

    seen = []
    monkeypatch.setattr(detectron2.evaluation, "inference_on_dataset", lambda model, data, evaluator: seen.append(
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)) or {})
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        runs.pytorch_run(torch.nn.Identity(), [], DatasetEvaluator(), pre={}, post={})
        assert seen == [(False, False)]
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
