"""`d2export synth text|boxes`: a labelled synthetic set written as COCO JSON beside its pictures.

Picture i is drawn from its own random stream, seeded by (seed, i), so the files are the same bytes for the same
arguments whatever the number of workers. Everything is written into a temporary folder beside the destination and
moved there only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

KINDS = ("text", "boxes")
ANNOTATIONS = "annotations.json"
IMAGES = "images"
JPEG_QUALITY = 92


def _module(kind: str):
    if kind == "text":
        from d2export.datasets import text as module
    elif kind == "boxes":
        from d2export.datasets import boxes as module
    else:
        raise ValueError(f"unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    return module


def draw(kind: str, seed: int, index: int, width: int, height: int) -> tuple[np.ndarray, list[dict]]:
    """Picture `index` of a set: (H, W, 3) uint8 RGB and its instances as the kind's module gives them (each picture
    from its own stream: the seed, the kind and the index)."""
    return _module(kind).sample(rng(kind, seed, index), width, height)


def rng(kind: str, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, KINDS.index(kind), index])


def _picture(job: tuple[str, int, int, int, int]) -> tuple[bytes, list[dict]]:
    """One picture, encoded, with its COCO annotations (no ids yet): what a worker returns."""
    import cv2

    cv2.setNumThreads(1)
    kind, seed, index, width, height = job
    img, instances = draw(kind, seed, index, width, height)
    module = _module(kind)
    anns = [a for a in map(module.annotation, instances) if a is not None]
    ok, jpeg = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    if not ok:
        raise RuntimeError(f"could not encode picture {index}")
    return jpeg.tobytes(), anns


def parse_size(text: str) -> tuple[int, int]:
    """'640x480' → (640, 480); one number means a square."""
    parts = text.lower().split("x")
    try:
        w, h = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        w = h = 0
    if w < 32 or h < 32:
        raise ValueError(f"size {text!r}: give WIDTHxHEIGHT, each at least 32 (e.g. 640x640)")
    return w, h


def generate(kind: str, out: str | Path, count: int, seed: int = 0, size: tuple[int, int] = (640, 640),
             workers: int | None = None, vis: int = 0, force: bool = False) -> Path:
    """Write `count` pictures of the kind and their COCO JSON into `out` (images/, annotations.json; vis/ with the
    labels drawn on the first `vis` pictures). Returns `out`."""
    from d2export.progress import steps

    module = _module(kind)
    out = Path(out)
    if count < 1:
        raise ValueError(f"count must be at least 1 (got {count})")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (--force replaces it)")
    width, height = size
    workers = max(1, min(workers or os.cpu_count() or 1, count))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / IMAGES).mkdir()
        images, annotations = [], []
        jobs = [(kind, seed, i, width, height) for i in range(count)]
        pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else None
        results = pool.map(_picture, jobs, chunksize=8) if pool else map(_picture, jobs)
        try:
            for i, (jpeg, anns) in enumerate(steps(results, f"synth {kind}", total=count)):
                name = f"{i:06d}.jpg"
                (tmp / IMAGES / name).write_bytes(jpeg)
                images.append({"id": i + 1, "file_name": name, "width": width, "height": height})
                for a in anns:
                    annotations.append({"id": len(annotations) + 1, "image_id": i + 1, **a})
        finally:
            if pool:
                pool.shutdown(cancel_futures=True)
        info = {"description": f"d2export synth {kind}", "kind": kind, "seed": seed, "count": count,
                "size": f"{width}x{height}"}
        if kind == "text":
            info.update(voc_size=module.VOC_SIZE, max_text_len=module.MAX_TEXT_LEN,
                        vocabulary_size=len(module.VOCABULARY), alphabet=module.ALPHABET)
        coco = {"info": info, "images": images, "annotations": annotations, "categories": module.CATEGORIES}
        (tmp / ANNOTATIONS).write_text(json.dumps(coco, separators=(",", ":")))
        if vis:
            from d2export.datasets.drawing import draw_set

            draw_set(tmp, min(vis, count))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def synth_main(argv: list[str] | None = None) -> int:
    from d2export.commandline import one_line, parser

    ap = parser("d2export synth", "Make a labelled synthetic set: pictures in DIR/images and COCO JSON in "
                f"DIR/{ANNOTATIONS}. The same arguments give the same bytes.",
                "examples:\n  d2export synth text --out data/synth_text --count 1000 --seed 0\n"
                "  d2export synth boxes --out data/synth_boxes --count 200 --size 512x384 --vis 8")
    ap.add_argument("kind", choices=KINDS, help="text: words along Beziers, AdelaiDet's TotalText-style labels; "
                    "boxes: shapes, COCO boxes and polygon masks")
    ap.add_argument("--out", help="destination folder, written whole or not at all (default: data/synth_KIND)")
    ap.add_argument("--count", type=int, default=100, help="number of pictures")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    ap.add_argument("--size", default="640x640", help="picture size WIDTHxHEIGHT")
    ap.add_argument("--workers", type=int, default=0, help="processes (default: one per CPU core)")
    ap.add_argument("--vis", type=int, nargs="?", const=8, default=0, metavar="N",
                    help="also draw the labels on the first N pictures into DIR/vis (N: 8 when omitted; default 0)")
    ap.add_argument("--force", action="store_true", help="replace a destination that is not empty")
    args = ap.parse_args(argv)
    try:
        out = generate(args.kind, args.out or f"data/synth_{args.kind}", args.count, args.seed, parse_size(args.size), args.workers or None,
                       args.vis, args.force)
    except (ValueError, FileExistsError) as e:
        print(one_line(e), file=sys.stderr)
        return 2
    except ImportError as e:
        print(one_line(f"{e}: pip install 'd2export[synth]' (OpenCV draws the sets)"), file=sys.stderr)
        return 2
    n = len(json.loads((out / ANNOTATIONS).read_text())["annotations"])
    print(f"wrote {args.count} pictures and {n} labelled instances to {out}")
    return 0
