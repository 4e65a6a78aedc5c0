"""Batch benchmark: pictures/s of `d2export infer` (one process) against `d2export batch` on a local Ray (actors x
threads), over the same generated pictures (a few corrupt), and whether their rows are identical.

Ray is started once before the batch runs and its start is reported on its own; each batch run's time includes its
actors' start and model load. `infer` runs first, before Ray exists, with onnxruntime's default threads.

    python tools/benchmark.py batch [--model model.onnx | --config textdet_tiny] [--pictures 300]
        [--runs 2x1,1x2] [--batch-size 8] [--sizes 480x640,480x640,480x640,600x400]
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from d2export.argparsing import parser


def uptime() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_pictures(folder: Path, count: int, sizes: list[tuple[int, int]], corrupt: int) -> None:
    from PIL import Image

    from d2export.resizing import synthetic_image

    for i in range(count):
        h, w = sizes[i % len(sizes)]
        Image.fromarray(synthetic_image(h, w, seed=i).transpose(1, 2, 0)).save(folder / f"{i:05d}.jpg", quality=90)
    for i in range(corrupt):
        data = (folder / f"{i:05d}.jpg").read_bytes()
        (folder / f"{i:05d}.jpg").write_bytes(data[: len(data) // 3])  # truncated


def rows_of(folder: Path) -> dict[str, dict]:
    import pyarrow.parquet as pq

    rows = {}
    for r in pq.read_table(folder).to_pylist():
        rows[r["path"]] = ({"error": r["error"]} if r["error"] is not None else
                           {"height": r["height"], "width": r["width"], "instances": json.loads(r["instances"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = parser("benchmark.py batch", __doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an exported .onnx; default: export --config into a temp dir")
    ap.add_argument("--config", default="textdet_tiny", help="config to export when no --model is given")
    ap.add_argument("--pictures", type=int, default=300, help="pictures in the corpus")
    ap.add_argument("--corrupt", type=int, default=5, help="how many of them are truncated")
    ap.add_argument("--sizes", default="480x640,480x640,480x640,600x400", help="original HxW, cycled")
    ap.add_argument("--runs", default="2x1,1x2", help="batch runs as ACTORSxTHREADS, comma-separated")
    ap.add_argument("--batch-size", type=int, default=8, help="pictures per session run")
    args = ap.parse_args(argv)

    from benchmarks.serve import exported
    from d2export.runtime import batch, infer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else exported(args.config, tmp)
        pictures = tmp / "pictures"
        pictures.mkdir()
        sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
        make_pictures(pictures, args.pictures, sizes, args.corrupt)
        print(f"model {model.name}, {args.pictures} pictures ({args.sizes}; {args.corrupt} truncated), "
              f"{len(os.sched_getaffinity(0))} cores; before: {uptime()}")

        results = []
        start = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):  # infer's error summary for the truncated pictures
            infer.main([str(model), str(pictures), "-o", str(tmp / "infer.jsonl"), "--no-progress"])
        seconds = time.perf_counter() - start
        expected = {str(Path(r.pop("file")).resolve()): r
                    for r in map(json.loads, (tmp / "infer.jsonl").read_text().splitlines())}
        results.append(("infer (1 process)", "-", seconds, len(expected)))

        start = time.perf_counter()
        runs = [tuple(map(int, r.split("x"))) for r in args.runs.split(",")]
        batch.connect(None, max(a * t for a, t in runs) + batch.DECODE_CPUS)
        ray_start = time.perf_counter() - start
        for actors, threads in runs:
            out = tmp / f"batch_{actors}x{threads}"
            summary = batch.run(model, str(pictures), str(out), actors=actors, threads=threads,
                                batch_size=args.batch_size)
            rows = rows_of(out)
            same = sum(rows.get(path) == line for path, line in expected.items())
            results.append((f"batch {actors}x{threads}", f"{same}/{len(expected)}", summary.seconds, summary.written))

    print(f"Ray start: {ray_start:.1f} s (not in the batch rows); after: {uptime()}")
    base = results[0][2] / results[0][3]
    print(f"{'run':<20} {'identical':>10} {'seconds':>8} {'pictures/s':>11} {'vs infer':>9}")
    for name, same, seconds, count in results:
        print(f"{name:<20} {same:>10} {seconds:>8.1f} {count / seconds:>11.1f} {base / (seconds / count):>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
