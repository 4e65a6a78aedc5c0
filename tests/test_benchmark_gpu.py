"""benchmarks/gpu.py's parts that need no GPU: the torch-2 fixes to a user's compiled-kernel sources, the refusal
where torch sees no CUDA device, the CUDA settings' rows and the options each passes to its session, the goals."""
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import torch2_sources

ROOT = Path(__file__).resolve().parent.parent

OLD = """at::Tensor f(const at::Tensor &value, const at::Tensor &loc) {
    AT_ASSERTM(value.type().is_cuda(), "value must be a CUDA tensor");
    AT_ASSERTM(loc.type().is_cuda(), "loc must be a CUDA tensor");
    AT_DISPATCH_FLOATING_TYPES(value.type(), "f_cuda", ([&] { g<scalar_t>(value); }));
    auto t = value.type();  // anything else is left alone
}
"""


def test_the_torch2_fixes_change_only_what_torch2_refuses(tmp_path):
    src = tmp_path / "src"
    (src / "cuda").mkdir(parents=True)
    (src / "cuda" / "op.cu").write_text(OLD)
    (src / "op.h").write_text("if (value.type().is_cuda()) {}\n")
    (src / "vision.cpp").write_text("#include \"op.h\"\n")
    (src / "README").write_text("value.type().is_cuda()")
    files = torch2_sources(src, tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in files) == ["cuda/op.cu", "vision.cpp"]
    fixed = (tmp_path / "out" / "cuda" / "op.cu").read_text()
    assert 'AT_ASSERTM(value.is_cuda(), "value' in fixed and 'AT_ASSERTM(loc.is_cuda(), "loc' in fixed
    assert 'AT_DISPATCH_FLOATING_TYPES(value.scalar_type(), "f_cuda"' in fixed
    assert "auto t = value.type();" in fixed and ".type().is_cuda()" not in fixed
    assert (tmp_path / "out" / "op.h").read_text() == "if (value.is_cuda()) {}\n"  # headers are copied and fixed
    assert not (tmp_path / "out" / "README").exists()
    assert (src / "cuda" / "op.cu").read_text() == OLD  # the user's files are untouched
    stamp = (tmp_path / "out" / "cuda" / "op.cu").stat().st_mtime_ns
    torch2_sources(src, tmp_path / "out")  # a second run (gpu_session.sh prep, then run) leaves them be: no rebuild
    assert (tmp_path / "out" / "cuda" / "op.cu").stat().st_mtime_ns == stamp


def test_without_a_gpu_the_benchmark_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark runs instead of refusing")
    done = subprocess.run([sys.executable, "tools/benchmark.py", "gpu"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "torch sees no CUDA device" in done.stderr


def test_gpu_activity_counts_kernels_copies_and_the_idle_span():
    from benchmarks.gpu import gpu_activity

    trace = {"traceEvents": [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host work is not GPU time
        {"cat": "kernel", "name": "gemm", "ts": 100, "dur": 300},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 450, "dur": 10},
        {"cat": "kernel", "name": "gather", "ts": 1000, "dur": 200},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 1300, "dur": 20},
    ]}
    assert gpu_activity(trace) == {"kernels": 2, "kernel_ms": 0.5, "copies_to_device": 1, "copies_other": 1,
                                   "gpu_span_ms": 1.22}
    assert gpu_activity({"traceEvents": []})["kernels"] == 0


def test_the_goals_are_eager_over_the_best_fused_row(capsys):
    """Ratios by hand: eager 30 ms a picture, fused float32 20 ms plain, 15 ms replaying a CUDA graph, 12 ms with
    d2export's defaults and a CUDA graph: 2.50x; a setting's own row (NHWC, 10 ms) is not a goal's figure."""
    from benchmarks.gpu import print_goals

    rows = {"eager, compiled MSDA kernel": {1: {"per_picture_ms": 30.0}},
            "onnxruntime CUDA, fused fixed-size, float32": {1: {"per_picture_ms": 20.0}},
            "onnxruntime CUDA, fused fixed-size, float32, CUDA graph": {1: {"per_picture_ms": 15.0},
                                                                        8: {"error": "refused"}},
            "onnxruntime CUDA, fused fixed-size, float32, d2export defaults, CUDA graph": {
                1: {"per_picture_ms": 12.0}, "options": {"cuda": {}}},
            "onnxruntime CUDA, fused fixed-size, float32, NHWC": {1: {"per_picture_ms": 10.0}}}
    print_goals({"rows": rows})
    out = capsys.readouterr().out
    assert ("batch 1: eager, compiled MSDA kernel / fused float32 (best of verified and d2export defaults, with and "
            "without CUDA graphs) = 2.50x") in out
    assert "batch 8" not in out and "float16" not in out
    print_goals({"rows": {}})
    assert "(rows missing)" in capsys.readouterr().out


CUDA = "CUDAExecutionProvider"
ROWS_FLOAT16 = ["", ", CUDA graph", ", tensor cores (use_tf32=1)", ", fused conv bias", ", MatMul+Add unfused",
                ", NHWC", ", d2export defaults", ", d2export defaults, CUDA graph"]


def test_each_setting_is_a_row_and_the_defaults_are_the_predictors():
    from benchmarks.gpu import DEFAULTS, fixed_rows, row_label, setting
    from d2export.runtime.providers import CUDA_DISABLED_OPTIMIZERS, options_per_provider

    labels = lambda precision, settings: [row_label("", n, g) for n, g in fixed_rows(precision, settings)]  # noqa
    assert labels("float16", True) == ROWS_FLOAT16
    assert labels("float32", True) == [r for r in ROWS_FLOAT16 if "tensor cores" not in r]  # float32 stays exact
    assert labels("float16", False) == ["", ", CUDA graph", ", d2export defaults", ", d2export defaults, CUDA graph"]
    for precision in ("float32", "float16"):
        assert setting(DEFAULTS, precision) == (options_per_provider([CUDA], precision=precision)[0],
                                                CUDA_DISABLED_OPTIMIZERS)
        assert setting(None, precision) == ({"use_tf32": "0"}, ())
    assert setting("NHWC", "float16") == ({"use_tf32": "0", "prefer_nhwc": "1"}, ())
    assert setting("MatMul+Add unfused", "float32") == ({"use_tf32": "0"}, ("MatMulAddFusion",))


def graph_file(path):
    """A one-node ONNX graph: what cuda_session reads for the custom operators it registers."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_each_rows_options_reach_its_session(tmp_path, monkeypatch):
    """Every row of the float16 fixed-size graph, built as the benchmark builds it, with onnxruntime's session
    recorded instead of made (no GPU here): the CUDA provider's options and the disabled transformers are the row's."""
    import onnxruntime as ort

    from benchmarks.gpu import cuda_session, fixed_rows, setting

    made = []

    class Recorded:
        def __init__(self, path, options, providers):
            entry = "optimization.disable_specified_optimizers"
            try:
                disabled = options.get_session_config_entry(entry)
            except RuntimeError:
                disabled = ""
            made.append((providers, disabled))

        def get_providers(self):
            return [CUDA, "CPUExecutionProvider"]

    monkeypatch.setattr(ort, "InferenceSession", Recorded)
    path = graph_file(tmp_path / "g.onnx")
    for name, graphs in fixed_rows("float16", True):
        options, disabled = setting(name, "float16")
        cuda_session(path, cuda_graph=graphs, options=options, disabled=disabled)
        providers, seen = made[-1]
        assert providers == [(CUDA, options | ({"enable_cuda_graph": "1"} if graphs else {})), "CPUExecutionProvider"]
        assert seen == ";".join(disabled)
    assert made[-1] == ([(CUDA, {"use_tf32": "1", "fuse_conv_bias": "1", "prefer_nhwc": "1", "enable_cuda_graph": "1"}),
                         "CPUExecutionProvider"], "MatMulAddFusion")  # the float16 defaults, by hand


def test_the_rows_are_built_without_a_gpu_and_each_says_why_it_did_not_run(tmp_path, monkeypatch, capsys):
    """graph_rows asks for one session per row with that row's options; here every session is refused (no CUDA),
    and each row records the refusal instead of stopping the others."""
    import argparse

    import benchmarks.gpu as gpu

    asked = []

    def refused(path, cuda_graph=False, options=None, disabled=()):
        asked.append((cuda_graph, options, disabled))
        raise RuntimeError("onnxruntime did not take the CUDA provider")

    monkeypatch.setattr(gpu, "cuda_session", refused)
    rows = {}
    which = gpu.fixed_rows("float32", True)
    gpu.graph_rows(rows, "fused, float32", which, "float32", tmp_path / "g.onnx", {8: {}}, argparse.Namespace(rounds=1),
                   tmp_path, {})
    assert list(rows) == [gpu.row_label("fused, float32", n, g) for n, g in which]
    assert all("did not take the CUDA provider" in row["error"] for row in rows.values())
    assert asked == [(g, *gpu.setting(n, "float32")) for n, g in which]
    gpu.print_table({"device": "none", "size": 640, "rows": rows}, [8])  # error rows print as missing figures
    assert "fused, float32, MatMul+Add unfused" in capsys.readouterr().out
