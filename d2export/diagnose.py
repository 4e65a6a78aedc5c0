"""`d2export diagnose`: the parity ladder for a configured model (see docs/ladder.md).

    d2export diagnose --config textdet_tiny [--sizes 160x224,224x160] [--all] [--json out.json] [overrides …]

Exit status 0 when every module agrees at every size, 1 when one diverges, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile

from d2export.cli import parser

def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x", 1)) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes are HxW,HxW…: {text!r}") from None


def diagnose_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser("d2export diagnose", "Name the first module where the ONNX export and PyTorch part ways.")
    ap.add_argument("--config", default="textdet", help="config name in configs/ or a YAML path")
    ap.add_argument("--sizes", type=_sizes, default=None, help="image sizes HxW,HxW… (default: verification sizes)")
    ap.add_argument("--all", action="store_true", help="print every row, not only up to the first divergence")
    ap.add_argument("--json", default=None, help="also write the report as JSON here (default: none)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. export.opset=16 export.sampler=grid_sample")
    args = ap.parse_args(argv)
    from d2export import pipeline
    from d2export.config import load

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="d2export-diagnose-") as tmp:
        # nothing is written there; the configs' output_dir may need Hydra's run directory, absent here
        overrides = args.overrides + ([] if any(o.startswith("export.output_dir=") for o in args.overrides)
                                      else [f"export.output_dir={tmp}"])
        try:
            report = pipeline.ladder(pipeline.prepare(load(args.config, overrides)), args.sizes)
        except (FileNotFoundError, ValueError) as e:
            print(f"d2export: error: {e}", file=sys.stderr)
            return 2
    print(report.format(all_rows=args.all))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 1 if report.culprit() else 0
