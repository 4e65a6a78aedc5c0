#!/usr/bin/env python
"""Benchmarks: `tools/benchmark.py SUBCOMMAND [args]`; each subcommand is a module under benchmarks/ with main(argv).
`tools/benchmark.py SUBCOMMAND --help` lists a subcommand's options."""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUBCOMMANDS = {  # subcommand -> ("module:function", one line)
    "msda": ("benchmarks.msda:main", "the MSDA core's samplers against known pure-PyTorch replacements"),
    "e2e": ("benchmarks.e2e:main", "the whole exported model against eager PyTorch: time, parity, float16"),
    "serve": ("benchmarks.serve:main", "the runtime: direct calls, HTTP, HTTP with batching"),
    "batch": ("benchmarks.batch:main", "infer against batch (Ray Data actors x threads): pictures/s"),
    "segmentation": ("benchmarks.segmentation:main", "Mask2Former-style segmenters: graph and served results against "
                     "the model's own forward, latency"),
    "native": ("benchmarks.native:main", "the fused operator's CPU library built per x86-64 level and with contraction: "
               "time and bits side by side"),
    "precision": ("benchmarks.precision:main", "served latency per precision (eager, float32, int8, bfloat16) and what "
                  "each serves against float32"),
    "gpu": ("benchmarks.gpu:main", "on an NVIDIA GPU: eager (compiled kernel, plugin) against onnxruntime CUDA"),
}


def usage() -> str:
    lines = [f"usage: benchmark.py {{{','.join(SUBCOMMANDS)}}} [args …]", "", __doc__.splitlines()[0], "",
             "subcommands:"]
    return "\n".join(lines + [f"  {name:<13}{what}" for name, (_, what) in SUBCOMMANDS.items()])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        print(usage() + (f"\n\nbenchmark.py: error: unknown subcommand {argv[0]!r}" if argv else ""), file=sys.stderr)
        return 2
    module, func = SUBCOMMANDS[argv[0]][0].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
