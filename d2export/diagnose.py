"""`d2export diagnose`: the parity ladder for a configured model (see docs/ladder.md).

    d2export diagnose --config textdet_tiny [--sizes 160x224,224x160] [--all] [--json out.json] [--vis DIR]
        [--images PICTURE …] [overrides …]

Exit status 0 when every module agrees at every size, 1 when one diverges, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

from d2export.argparsing import parser
from d2export.resizing import synthetic_image


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x", 1)) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes are HxW,HxW…: {text!r}") from None


def _pictures(files: list[str], sizes) -> list[tuple[str, np.ndarray]]:
    """(name, HWC RGB uint8) from files, or synthetic pictures at the given sizes."""
    if files:
        from d2export.runtime.image_decoding import read_image

        return [(Path(f).stem, read_image(f)) for f in files]
    return [(f"synthetic_{h}x{w}", synthetic_image(h, w, seed=i).transpose(1, 2, 0))
            for i, (h, w) in enumerate(sizes)]


def diagnose_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser("d2export diagnose", "Name the first module where the ONNX export and PyTorch part ways.")
    ap.add_argument("--config", default="textdet", help="config name in configs/ or a YAML path")
    ap.add_argument("--sizes", type=_sizes, default=None, help="image sizes HxW,HxW… (default: verification sizes)")
    ap.add_argument("--all", action="store_true", help="print every row, not only up to the first divergence")
    ap.add_argument("--json", default=None, help="also write the report as JSON here (default: none)")
    ap.add_argument("--vis", default=None, metavar="DIR", help="also write PyTorch | ONNX results side by side as "
                    "<DIR>/<picture>.png (default: none)")
    ap.add_argument("--images", nargs="+", default=[], metavar="PICTURE",
                    help="pictures for --vis (default: synthetic ones at --sizes or the verification sizes)")
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
            built = pipeline.prepare(load(args.config, overrides))
            report = pipeline.ladder(built, args.sizes)
            if args.vis:
                from d2export.side_by_side import side_by_side_pictures

                for path in side_by_side_pictures(built, _pictures(args.images, args.sizes or
                                                                   pipeline.verification_sizes(built.cfg)),
                                                  Path(args.vis)):
                    print(f"wrote {path} (PyTorch left, ONNX right)")
        except (FileNotFoundError, ValueError) as e:
            print(f"d2export: error: {e}", file=sys.stderr)
            return 2
    print(report.format(all_rows=args.all))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 1 if report.culprit() else 0
