"""`make demo`: export the trained micro text spotter, draw pictures it never saw, and let the exported graph read them.

Steps, each printed as it runs: export `configs/textdet_micro.yaml` (verified against PyTorch, as every export) into
outputs/demo/model; render --count pictures with `d2export synth text` from --seed (3: the spotter trained on seed 0,
was tuned on seed 2 and scored on seed 1); run `d2export infer --vis` on them with onnxruntime; print each picture's
words beside what the graph read, and where the pictures are (one per input, and grid.png of them all).

    python tools/demo.py                 # what `make demo` runs
    python tools/demo.py --count 8 --seed 11
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def grid(pictures: list[Path], columns: int, cell: int = 320):
    """The pictures side by side, each fitted into a `cell`-pixel square."""
    from PIL import Image

    rows = -(-len(pictures) // columns)
    sheet = Image.new("RGB", (columns * cell, rows * cell), "white")
    for i, path in enumerate(pictures):
        with Image.open(path) as im:
            im.thumbnail((cell, cell))
            sheet.paste(im.convert("RGB"), ((i % columns) * cell, (i // columns) * cell))
    return sheet


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/demo", help="where the model, the pictures and what was read go")
    ap.add_argument("--count", type=int, default=6, help="pictures to render and read")
    ap.add_argument("--seed", type=int, default=3, help="seed of the pictures (not 0, 1 or 2: the spotter's sets)")
    ap.add_argument("--size", default="320x320", help="picture size, as the spotter was trained")
    args = ap.parse_args(argv)
    if args.count < 1:
        ap.error("--count must be at least 1")
    out = (REPO / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    started = time.time()

    from d2export import pipeline
    from d2export.config import load

    print("1/3 exporting the trained micro spotter (configs/textdet_micro.yaml), verified against PyTorch ...",
          flush=True)
    manifest = pipeline.export(load("textdet_micro", [f"export.output_dir={out / 'model'}"]))
    model = out / "model" / manifest.model_file

    from d2export.datasets import generate
    from d2export.datasets.synth import parse_size

    print(f"2/3 rendering {args.count} pictures it never saw (d2export synth text --seed {args.seed}) ...",
          flush=True)
    data = generate("text", out / "pictures", count=args.count, seed=args.seed, size=parse_size(args.size),
                    workers=1, force=True)

    from d2export.charset import charset, decode
    from d2export.datasets.text import VOC_SIZE
    from d2export.runtime import infer

    print("3/3 reading them with onnxruntime (d2export infer --vis) ...", flush=True)
    vis, results = out / "vis", out / "results.jsonl"
    code = infer.main([str(model), str(data / "images"), "--vis", str(vis), "-o", str(results), "--no-progress"])
    if code:
        return code

    truth: dict[str, list[str]] = {}
    coco = json.loads((data / "annotations.json").read_text())
    names = {im["id"]: Path(im["file_name"]).name for im in coco["images"]}
    for a in coco["annotations"]:
        truth.setdefault(names[a["image_id"]], []).append(decode(a["rec"], charset(VOC_SIZE)))
    words = read = 0
    for line in results.read_text().splitlines():
        row = json.loads(line)
        name = Path(row["file"]).name
        said = [i.get("text", "") for i in row.get("instances", [])]
        expected = truth.get(name, [])
        hits = Counter(w.lower() for w in said) & Counter(w.lower() for w in expected)  # case ignored, as evaluated
        words, read = words + len(expected), read + sum(hits.values())
        print(f"  {name}: words {' '.join(sorted(expected))} | read {' '.join(sorted(said)) or '-'}")
    pictures = sorted(vis.glob("*.png"))
    grid(pictures, min(3, len(pictures))).save(out / "grid.png")
    print(f"read {read} of {words} words (case ignored, as d2export evaluate counts), in {time.time() - started:.0f} s")
    print(f"pictures: {vis}/ (one per input) and {out / 'grid.png'}; what was read: {results}; model: {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
