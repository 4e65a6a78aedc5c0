"""Benchmarks: `tools/benchmark.py <subcommand> [args]`; each subcommand is a module under benchmarks/ with main()."""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUBCOMMANDS = {  # subcommand -> "module:function"
    "msda": "benchmarks.msda:main",
    "e2e": "benchmarks.e2e:main",
    "serve": "benchmarks.serve:main",
    "batch": "benchmarks.batch:main",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        sys.exit(f"usage: benchmark.py {{{','.join(SUBCOMMANDS)}}} [args]  (--help after a subcommand for its args)")
    module, func = SUBCOMMANDS[argv[0]].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    main()
