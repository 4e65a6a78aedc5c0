"""The fused MSDA operator's CPU library built several ways, side by side in one run, at TESTR's shapes:

    .venv/bin/python tools/benchmark.py native [--size 640] [--threads 1] [--rounds 9]

- "installed": the library setup.py built (target clones, no multiply-add contraction);
- "contracted": the same clones built with contraction (GCC's default): its AVX-512 clone fuses multiply-adds;
- one build per x86-64 level this CPU runs (x86-64, x86-64-v3, x86-64-v4), clones off: what each clone computes.
Each is loaded into its own onnxruntime session of one fused node; timed in interleaved rounds (medians), and its
outputs compared bit for bit with the installed library's. Prints the CPU and its features, which decide the clone used.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.e2e import interleaved
from benchmarks.msda import make_inputs
from d2export.argparsing import parser
from d2export.cpu import describe_cpu
from d2export.kernels import custom_ops, native_build

def builds(folder: Path) -> dict[str, str]:
    """name -> library path: the installed library, the contracted clones and one build per runnable level."""
    installed = custom_ops.native_library()
    if installed is None:
        raise SystemExit("the native MSDA library is not built: `make setup` (a C++ compiler is needed)")
    found = {"installed": installed,
             "contracted": str(native_build.build(folder / "contracted.so", contract=True))}
    for level in native_build.runnable_levels():
        found[level] = str(native_build.build(folder / f"{level}.so", level=level))
    return found


def main(argv=None):
    p = parser("benchmark.py native", __doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=640, help="square input size (levels at strides 8-64)")
    p.add_argument("--decoder-queries", type=int, default=2500, help="queries of the decoder-shaped call")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    p.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds (medians)")
    args = p.parse_args(argv)
    import onnxruntime as ort

    print(f"# {describe_cpu()}; onnxruntime {ort.__version__}, {args.threads} thread(s)")
    model = custom_ops.fused_msda_model()
    with tempfile.TemporaryDirectory() as folder:
        libraries = builds(Path(folder))
        sessions = {}
        for name, library in libraries.items():
            options = ort.SessionOptions()
            options.intra_op_num_threads = args.threads
            options.register_custom_ops_library(library)
            sessions[name] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        for label, lq in (("encoder", None), (f"decoder {args.decoder_queries}", args.decoder_queries)):
            feed = dict(zip(custom_ops.FUSED_MSDA_INPUTS, (t.numpy() for t in make_inputs(args.size, lq))))
            outs = {name: s.run(None, feed)[0] for name, s in sessions.items()}
            times = interleaved({name: (lambda s=s: s.run(None, feed)) for name, s in sessions.items()}, args.rounds)
            base = outs["installed"]
            print(f"\n{label} call at {args.size}² (Lq {base.shape[1]}):")
            for name, seconds in times.items():
                differ = np.abs(outs[name].astype(np.float64) - base).max() / np.abs(base).max()
                same = "same bits" if np.array_equal(outs[name], base) else f"differs by {differ:.1e} of the scale"
                print(f"  {name:12s} {seconds * 1e3:8.2f} ms  {seconds / times['installed']:5.2f}x installed  {same}")
    return 0
