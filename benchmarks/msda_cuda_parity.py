"""The fused MSDA operator's CUDA kernel against its CPU kernel, bit for bit, with no onnxruntime on the GPU machine.

    python benchmarks/msda_cuda_parity.py write DIR     # here: the cases' inputs and the harness, built with nvcc
    DIR/msda_cuda_parity DIR/case_*                      # on the GPU machine: the CUDA kernel's outputs beside them
    python benchmarks/msda_cuda_parity.py check DIR     # here: the installed CPU library (onnxruntime) on the same
                                                         # inputs, bit for bit, and float32 against float64

docs/performance.md claims the CPU kernel's clones and the CUDA kernel compute the same bits (msda_sample.h writes its
multiply-adds out; -ffp-contract=off, nvcc -fmad=false). The harness (msda_cuda_parity.cu) includes the kernel's own
translation unit and launches it directly, on both of its paths (8 channels a thread with 16-byte loads, and one),
for the three variants (value/output float32 or float16 × locations/weights float32 or float16). The cases: TESTR's
encoder levels at 640² (80², 40², 20², 10²; 8 heads of 32 channels; 4 points), a batch of three on non-square levels
with 12 channels (the scalar path only), and a decoder-like case; locations drawn past the levels' edges, with NaNs
and points far outside. Exits 1 on any difference.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "d2export" / "kernels" / "native"
CASES = {  # name: (batch, levels (H, W), heads, dim, queries, points)
    "encoder_640": (1, [(80, 80), (40, 40), (20, 20), (10, 10)], 8, 32, 1200, 4),
    "batch3_nonsquare_d12": (3, [(37, 23), (19, 12), (10, 6)], 4, 12, 300, 3),
    "decoder_batch2": (2, [(24, 40), (12, 20), (6, 10), (3, 5)], 8, 32, 1600, 4),
}
VARIANTS = [("f32", "f32"), ("f16", "f32"), ("f16", "f16")]  # (value and output, locations and weights)
TYPES = {"f32": np.float32, "f16": np.float16}


def write(directory: Path, seed: int = 2026) -> None:
    rng = np.random.default_rng(seed)
    for name, (batch, levels, heads, dim, queries, points) in CASES.items():
        case = directory / f"case_{name}"
        case.mkdir(parents=True, exist_ok=True)
        sizes = [h * w for h, w in levels]
        starts = np.cumsum([0] + sizes[:-1])
        dims = [batch, sum(sizes), heads, dim, queries, len(levels), points]
        np.array(dims + [v for hw in levels for v in hw] + list(starts), np.int64).tofile(case / "dims.bin")
        # float16-representable values, so both value precisions read the very same numbers
        value = rng.standard_normal((batch, sum(sizes), heads, dim)).astype(np.float16).astype(np.float32)
        loc = rng.uniform(-0.15, 1.15, (batch, queries, heads, len(levels), points, 2)).astype(np.float32)
        flat = loc.reshape(-1)
        flat[rng.choice(flat.size, 40, replace=False)] = np.nan
        flat[rng.choice(flat.size, 40, replace=False)] = rng.choice([-7.5, 9.0, 1.0, 0.0, -0.0], 40)
        attn = rng.uniform(0, 1, (batch, queries, heads, len(levels), points)).astype(np.float32)
        attn /= attn.reshape(batch, queries, heads, -1).sum(-1)[..., None, None]
        for kind, dtype in TYPES.items():
            value.astype(dtype).tofile(case / f"value_{kind}.bin")
            loc.astype(dtype).tofile(case / f"loc_{kind}.bin")
            attn.astype(dtype).tofile(case / f"attn_{kind}.bin")
    host = ",".join(["-fPIC", "-ffp-contract=off", "-fno-wrapv"])
    arch = [f for sm in (80, 90) for f in ("-gencode", f"arch=compute_{sm},code=sm_{sm}")]
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-fmad=false", "-DD2_MSDA_CUDA=1", "-Xcompiler", host, *arch,
                    "-cudart", "static", "-o", str(directory / "msda_cuda_parity"),
                    str(ROOT / "benchmarks" / "msda_cuda_parity.cu"), str(NATIVE / "msda_op.cc")], check=True)
    print(f"wrote {len(CASES)} cases and the harness under {directory}")


def _case(case: Path):
    d = np.fromfile(case / "dims.bin", np.int64)
    batch, tokens, heads, dim, queries, n_levels, points = (int(v) for v in d[:7])
    shapes = d[7:7 + 2 * n_levels].reshape(n_levels, 2)
    starts = d[7 + 2 * n_levels:]
    return (batch, tokens, heads, dim, queries, n_levels, points), shapes, starts


def check(directory: Path) -> int:
    import onnxruntime as ort
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    from msda_reference import msda_reference

    from d2export.kernels import custom_ops

    library = custom_ops.native_library()
    failures = compared = 0
    for case in sorted(directory.glob("case_*")):
        (batch, tokens, heads, dim, queries, n_levels, points), shapes, starts = _case(case)
        read = {k: {n: np.fromfile(case / f"{n}_{k}.bin", t) for n in ("value", "loc", "attn")}
                for k, t in TYPES.items()}
        value_shape = (batch, tokens, heads, dim)
        loc_shape = (batch, queries, heads, n_levels, points, 2)
        # the reference indexes with its coordinates: a NaN point (which contributes nothing) as one far outside
        outside = np.nan_to_num(read["f32"]["loc"], nan=-10.0).reshape(loc_shape)
        reference = msda_reference(torch.from_numpy(read["f32"]["value"].reshape(value_shape)),
                                   torch.from_numpy(shapes), torch.from_numpy(starts), torch.from_numpy(outside),
                                   torch.from_numpy(read["f32"]["attn"].reshape(loc_shape[:-1]))).numpy()
        for value_kind, sampling_kind in VARIANTS:
            options = ort.SessionOptions()
            options.register_custom_ops_library(library)
            options.intra_op_num_threads = 2
            names = {"f32": "float", "f16": "float16"}
            session = ort.InferenceSession(custom_ops.fused_msda_model(names[value_kind], names[sampling_kind]),
                                           options, providers=["CPUExecutionProvider"])
            feed = dict(zip(custom_ops.FUSED_MSDA_INPUTS, [
                read[value_kind]["value"].reshape(value_shape), shapes, starts,
                read[sampling_kind]["loc"].reshape(loc_shape), read[sampling_kind]["attn"].reshape(loc_shape[:-1])]))
            cpu = session.run(None, feed)[0].reshape(-1)
            if value_kind == "f32" and sampling_kind == "f32":
                err = np.abs(cpu.astype(np.float64) - reference.reshape(-1))
                bound = 1e-6 * (np.abs(reference.reshape(-1)) + np.abs(reference).max())
                print(f"{case.name}: CPU float32 against float64: max error {err.max():.2e} "
                      f"({'within' if (err <= bound).all() else 'OUTSIDE'} tests/test_native_msda.py's bound)")
                failures += int(not (err <= bound).all())
            for path in sorted(case.glob(f"cuda_{value_kind}_{sampling_kind}_v*.bin")):
                cuda = np.fromfile(path, TYPES[value_kind])
                same = cuda.size == cpu.size and np.array_equal(cuda.view(np.uint8), cpu.view(np.uint8))
                differing = int((cuda.view(np.uint8) != cpu.view(np.uint8)).sum()) if cuda.size == cpu.size else -1
                print(f"  {path.stem}: {cuda.size} outputs, {'bit for bit equal' if same else 'DIFFERENT'} to the CPU "
                      f"kernel{'' if same else f' ({differing} bytes differ)'}")
                failures += int(not same)
                compared += 1
                if same:  # the comparison itself can fail: the same outputs with one of them one ulp off
                    off = cuda.copy()
                    off.view(np.uint16 if off.itemsize == 2 else np.uint32)[off.size // 2] += 1
                    failures += int(np.array_equal(off.view(np.uint8), cpu.view(np.uint8)))
    if compared == 0:
        print("no CUDA outputs found: run the harness on the GPU machine first")
        return 1
    print(f"{compared} CUDA outputs compared, {failures} failure(s); CPU library {Path(library).name}")
    return int(failures > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["write", "check"])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    if args.step == "write":
        write(args.directory)
        return 0
    return check(args.directory)


if __name__ == "__main__":
    sys.exit(main())
