"""benchmarks/gpu.py's parts that need no GPU: the torch-2 fixes to a user's compiled-kernel sources, and the refusal
where torch sees no CUDA device."""
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
    """Ratios by hand: eager 30 ms a picture, fused float32 20 ms plain and 15 ms replaying a CUDA graph: 2.00x."""
    from benchmarks.gpu import print_goals

    rows = {"eager, compiled MSDA kernel": {1: {"per_picture_ms": 30.0}},
            "onnxruntime CUDA, fused fixed-size, float32": {1: {"per_picture_ms": 20.0}},
            "onnxruntime CUDA, fused fixed-size, float32, CUDA graph": {1: {"per_picture_ms": 15.0},
                                                                        8: {"error": "refused"}}}
    print_goals({"rows": rows})
    out = capsys.readouterr().out
    assert "batch 1: eager, compiled MSDA kernel / fused float32 (best of with and without CUDA graphs) = 2.00x" in out
    assert "batch 8" not in out and "float16" not in out
    print_goals({"rows": {}})
    assert "(rows missing)" in capsys.readouterr().out
