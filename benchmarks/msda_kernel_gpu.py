"""The fused MSDA operator's CUDA kernel alone, on an NVIDIA GPU: parity and time at TESTR's shapes.

    python benchmarks/msda_kernel_gpu.py [--upstream-msda DIR] [--batches 1 8] [--rounds 50] [--json FILE]

One-node graphs (d2export.MultiScaleDeformableAttention) on onnxruntime's CUDA provider, at TESTR's 640² shapes: 4
levels (80², 40², 20², 10²: strides 8–64), 8 heads, 32 channels, 4 points; the encoder (Lq = all 8,500 tokens) and
the two decoders (100 proposals × 16 control points = 1,600 queries; × 25 characters = 2,500), at each batch; in
float32 and in float16 (value and output float16, locations and weights float32: a float16 graph's fused node with
export.fp16_fused=float16).

Parity, per case (the value drawn float16-representable, so that both precisions read the very same numbers):
- float32 against the float64 reference (tests/msda_reference.py) within tests/test_native_msda.py's bound, and
  against the CPU kernel (the same library on the CPU provider) bit for bit (both sum the same terms in the same
  order, -fmad=false);
- float16 bit for bit the float32 kernel's output rounded once to float16 (what the kernel promises), and so within
  one float16 rounding of the reference.
Time, per case: onnxruntime's call with IO binding (inputs and output stay on the GPU; one node's run overhead
included), and the kernel's own time on the GPU (torch's profiler, CUPTI); with --upstream-msda (Deformable-DETR's
`models/ops`, built here as benchmarks/gpu.py builds it) upstream's compiled float32 kernel at the same inputs: its call
and its kernels' time, and its parity. Medians of --rounds calls after 2 s of warm-up.

Without a CUDA GPU, onnxruntime's CUDA provider or d2export's CUDA library it says so in one line and exits 0.
Exits 1 when a parity check fails.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

LEVELS = [(80, 80), (40, 40), (20, 20), (10, 10)]  # TESTR at 640²: strides 8, 16, 32, 64
HEADS, DIM, POINTS = 8, 32, 4
SHAPES = {"encoder": sum(h * w for h, w in LEVELS), "decoder, control points": 100 * 16,
          "decoder, characters": 100 * 25}
NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]
RTOL = 1e-6  # tests/test_native_msda.py's float32 bound: RTOL * (|want| + max|want|)


def unavailable() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "no onnxruntime"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDA provider here (install onnxruntime-gpu)"
    from d2export.kernels import custom_ops

    if custom_ops.cuda_library() is None:
        return "d2export's CUDA MSDA library is not built (no nvcc when it was installed)"
    try:
        import torch
    except ImportError:
        return "no torch (the reference and the kernel timings need it)"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


def one_node(value_type: int):
    from onnx import TensorProto

    from d2export.kernels import custom_ops

    return custom_ops.fused_msda_model("float16" if value_type == TensorProto.FLOAT16 else "float")


def session(model: bytes, provider: str):
    import onnxruntime as ort

    from d2export.kernels import custom_ops

    options = ort.SessionOptions()
    options.register_custom_ops_library(custom_ops.cuda_library())
    providers = [("CUDAExecutionProvider", {"device_id": 0, "use_tf32": 0}), "CPUExecutionProvider"] \
        if provider == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(model, options, providers=providers)


def inputs(batch: int, queries: int, seed: int) -> list[np.ndarray]:
    """Value float16-representable; locations in [-0.1, 1.1] (some points in the padding), softmax weights."""
    rng = np.random.default_rng(seed)
    areas = [h * w for h, w in LEVELS]
    value = rng.standard_normal((batch, sum(areas), HEADS, DIM)).astype(np.float16).astype(np.float32)
    loc = rng.uniform(-0.1, 1.1, (batch, queries, HEADS, len(LEVELS), POINTS, 2)).astype(np.float32)
    logits = rng.standard_normal((batch, queries, HEADS, len(LEVELS) * POINTS))
    attn = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return [value, np.array(LEVELS, np.int64), np.cumsum([0] + areas[:-1]).astype(np.int64), loc,
            attn.reshape(batch, queries, HEADS, len(LEVELS), POINTS).astype(np.float32)]


def reference(args) -> np.ndarray:
    import torch

    from msda_reference import msda_reference

    with torch.no_grad():
        return msda_reference(*(torch.from_numpy(a) for a in args)).numpy()


def bound_call(sess, args):
    """A call of `sess` with IO binding: inputs on the GPU (the level tables on the host, as the op declares them),
    the output preallocated on the GPU; returns (call, read the output back)."""
    import onnxruntime as ort

    binding = sess.io_binding()
    for name, array in zip(NAMES, args):
        if name in ("spatial_shapes", "level_start_index"):
            binding.bind_cpu_input(name, array)
        else:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    n, lq = args[3].shape[:2]
    out = ort.OrtValue.ortvalue_from_shape_and_type([n, lq, HEADS * DIM], args[0].dtype.type, "cuda", 0)
    binding.bind_ortvalue_output("out", out)

    def call():
        sess.run_with_iobinding(binding)  # synchronises the provider's stream at the end of the run

    return call, lambda: binding.copy_outputs_to_cpu()[0]


def median_ms(call, rounds: int) -> float:
    import torch

    from benchmarks.gpu import warm_up

    warm_up(call)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def kernel_ms(call, name: str, rounds: int, tmp: Path) -> float:
    """The summed GPU time, per call, of the kernels whose name holds `name` (CUPTI, through torch's profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            call()
        torch.cuda.synchronize()
    path = tmp / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text()).get("traceEvents", [])
              if e.get("cat") == "kernel" and name in e.get("name", "")]
    return sum(e["dur"] for e in events) / 1e3 / rounds if events else float("nan")


def close32(out: np.ndarray, want: np.ndarray) -> float:
    """The worst |out - want| / (|want| + max|want|): within RTOL passes."""
    return float((np.abs(out.astype(np.float64) - want) / (np.abs(want) + np.abs(want).max())).max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream-msda", help="Deformable-DETR's MSDA sources (models/ops or its src/), to time against")
    p.add_argument("--build-dir", help="where upstream's extension is built (a build there already is reused; "
                   "default: a new temporary folder)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"msda_kernel_gpu: not run: {why}")
        return 0

    import torch
    from onnx import TensorProto

    from benchmarks.gpu import build_upstream

    tmp = Path(tempfile.mkdtemp(prefix="msda_kernel_gpu_"))  # the profiler's traces
    build_dir = Path(args.build_dir) if args.build_dir else tmp / "upstream"
    upstream = build_upstream(Path(args.upstream_msda), build_dir) if args.upstream_msda else None
    models = {"float32": one_node(TensorProto.FLOAT), "float16": one_node(TensorProto.FLOAT16)}
    cuda = {k: session(m, "cuda") for k, m in models.items()}
    cpu = session(models["float32"], "cpu")
    rows, failed = [], []
    print(f"{torch.cuda.get_device_name()}; ms, medians of {args.rounds} calls")
    print(f"{'shape':<26}{'batch':>6}{'precision':>10}{'call':>9}{'kernel':>9}{'upstream call':>15}"
          f"{'upstream kernel':>17}  parity")
    for seed, (label, queries) in enumerate(SHAPES.items()):
        for batch in args.batches:
            feed = inputs(batch, queries, seed)
            want = reference(feed)
            results = {}
            for precision, sess in cuda.items():
                fed = [feed[0].astype(np.float16) if precision == "float16" else feed[0], *feed[1:]]
                call, read = bound_call(sess, fed)
                call()
                out = read()
                results[precision] = out
                row = {"shape": label, "queries": queries, "batch": batch, "precision": precision,
                       "call_ms": median_ms(call, args.rounds), "kernel_ms": kernel_ms(call, "msda_forward", 10, tmp)}
                if precision == "float32":
                    cpu_out = cpu.run(None, dict(zip(NAMES, feed)))[0]
                    row["reference_rel"] = close32(out, want)
                    row["cpu_bit_equal"] = bool(np.array_equal(out, cpu_out))
                    ok = row["reference_rel"] <= RTOL and row["cpu_bit_equal"]
                else:
                    row["float32_rounded_bit_equal"] = bool(np.array_equal(out, results["float32"].astype(np.float16)))
                    row["reference_max_abs"] = float(np.abs(out.astype(np.float64) - want).max())
                    ok = row["float32_rounded_bit_equal"]
                if upstream is not None and precision == "float32":
                    tensors = [torch.from_numpy(a).cuda() for a in feed]
                    up_call = lambda: upstream.ms_deform_attn_forward(*tensors, 64)  # noqa: E731 - im2col_step 64
                    row["upstream_call_ms"] = median_ms(up_call, args.rounds)
                    row["upstream_kernel_ms"] = kernel_ms(up_call, "ms_deformable_im2col", 10, tmp)
                    row["upstream_reference_rel"] = close32(up_call().cpu().numpy(), want)
                row["ok"] = ok
                rows.append(row)
                if not ok:
                    failed.append(f"{label} batch {batch} {precision}")
                parity = (f"ref {row['reference_rel']:.1e}, CPU bit-equal {row['cpu_bit_equal']}"
                          if precision == "float32" else
                          f"= float32 rounded: {row['float32_rounded_bit_equal']}, ref {row['reference_max_abs']:.1e}")
                up = (f"{row['upstream_call_ms']:>15.3f}{row['upstream_kernel_ms']:>17.3f}" if "upstream_call_ms" in row
                      else f"{'-':>15}{'-':>17}")
                print(f"{label:<26}{batch:>6}{precision:>10}{row['call_ms']:>9.3f}{row['kernel_ms']:>9.3f}{up}  "
                      f"{parity}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    if failed:
        print("parity FAILED: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
