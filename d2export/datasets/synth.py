"""`d2export synth text|boxes`: a labelled synthetic set written as COCO JSON beside its pictures (and, for boxes on
request, per-pixel labels: semantic PNGs, COCO-panoptic PNGs and JSON).

Picture i is drawn from its own random stream, seeded by (seed, i), so the files are the same bytes for the same
arguments whatever the number of workers. Everything is written into a temporary folder beside the destination and
moved there only when complete.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from d2export.datasets.layout import ANNOTATIONS, IMAGES, PANOPTIC, PANOPTIC_JSON, SEMANTIC

KINDS = ("text", "boxes")
JPEG_QUALITY = 92
# workers unasked, a process pool only where drawing the pictures alone would take longer than this: each worker
# imports the calling script again (a training script's torch and detectron2: about 5 s on 2 cores; 4 pictures took
# 6.1 s through a pool of 2 against 0.12 s in the caller)
POOL_PAYS_AFTER_S = 10.0


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


def _encode(ext: str, img: np.ndarray, index: int, *params: int) -> bytes:
    import cv2

    ok, data = cv2.imencode(ext, img, list(params))
    if not ok:
        raise RuntimeError(f"could not encode picture {index} as {ext}")
    return data.tobytes()


def _picture(job: tuple) -> tuple[bytes, list[dict], tuple[bytes, bytes, list[dict]] | None]:
    """One picture, encoded, with its COCO annotations (no ids yet) and, where the job's optional sixth item asks,
    its per-pixel labels (semantic PNG, panoptic PNG, segments_info; else None): what a worker returns."""
    import cv2

    cv2.setNumThreads(1)
    kind, seed, index, width, height, *per_pixel = job
    module = _module(kind)
    if per_pixel and per_pixel[0]:
        img, instances, stuff = module.scene(rng(kind, seed, index), width, height)
    else:
        (img, instances), stuff = draw(kind, seed, index, width, height), None
    labelled = [(i, a) for i, a in zip(instances, map(module.annotation, instances)) if a is not None]
    jpeg = _encode(".jpg", img[..., ::-1], index, cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY)
    labels = None
    if stuff is not None:
        semantic, panoptic, segments = module.pixel_labels([i for i, _ in labelled], stuff, height, width)
        rgb = np.stack([panoptic % 256, panoptic // 256 % 256, panoptic // 65536], axis=-1).astype(np.uint8)
        labels = _encode(".png", semantic, index), _encode(".png", rgb[..., ::-1], index), segments
    return jpeg, [a for _, a in labelled], labels


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
             workers: int | None = None, vis: int = 0, force: bool = False, segmentation: bool = False) -> Path:
    """Write `count` pictures of the kind and their COCO JSON into `out` (images/, annotations.json; vis/ with the
    labels drawn on the first `vis` pictures; with `segmentation` (boxes only) also semantic/, panoptic/ and
    panoptic.json). `workers`: processes drawing them; unasked, one per core where the set is large enough to pay for
    starting them. Returns `out`."""
    from d2export.progress import steps

    module = _module(kind)
    out = Path(out)
    if count < 1:
        raise ValueError(f"count must be at least 1 (got {count})")
    if segmentation and not hasattr(module, "scene"):
        raise ValueError(f"--segmentation: the {kind} set has no per-pixel labels (the boxes set has)")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (--force replaces it)")
    width, height = size
    processes = max(1, min(workers or os.cpu_count() or 1, count))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / IMAGES).mkdir()
        if segmentation:
            (tmp / SEMANTIC).mkdir()
            (tmp / PANOPTIC).mkdir()
        images, annotations, panoptic = [], [], []
        jobs = [(kind, seed, i, width, height, segmentation) for i in range(count)]
        started = time.perf_counter()
        first = _picture(jobs[0])  # each picture is its index's alone: the same bytes in this process or a worker
        if workers is None and (time.perf_counter() - started) * (count - 1) < POOL_PAYS_AFTER_S:
            processes = 1
        pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn")) if processes > 1 else None
        rest = pool.map(_picture, jobs[1:], chunksize=8) if pool else map(_picture, jobs[1:])
        results = itertools.chain([first], rest)
        try:
            for i, (jpeg, anns, labels) in enumerate(steps(results, f"synth {kind}", total=count)):
                name = f"{i:06d}.jpg"
                (tmp / IMAGES / name).write_bytes(jpeg)
                images.append({"id": i + 1, "file_name": name, "width": width, "height": height})
                for a in anns:
                    annotations.append({"id": len(annotations) + 1, "image_id": i + 1, **a})
                if labels:
                    semantic, ids, segments = labels
                    png = f"{i:06d}.png"
                    (tmp / SEMANTIC / png).write_bytes(semantic)
                    (tmp / PANOPTIC / png).write_bytes(ids)
                    panoptic.append({"image_id": i + 1, "file_name": png, "segments_info": segments})
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
        if segmentation:
            pan = {"info": info, "images": images, "annotations": panoptic, "categories": module.PANOPTIC_CATEGORIES}
            (tmp / PANOPTIC_JSON).write_text(json.dumps(pan, separators=(",", ":")))
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
    from d2export.argparsing import one_line, parser

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
    ap.add_argument("--workers", type=int, default=0,
                    help="processes (default: one per CPU core where the set pays for starting them)")
    ap.add_argument("--vis", type=int, nargs="?", const=8, default=0, metavar="N",
                    help="also draw the labels on the first N pictures into DIR/vis (N: 8 when omitted; default 0)")
    ap.add_argument("--segmentation", action="store_true", help=f"boxes: also per-pixel labels, the shapes as "
                    f"things and the bars and background as stuff: DIR/{SEMANTIC}/*.png (each pixel's class, 255 "
                    f"void), DIR/{PANOPTIC}/*.png and DIR/{PANOPTIC_JSON} (COCO panoptic)")
    ap.add_argument("--force", action="store_true", help="replace a destination that is not empty")
    args = ap.parse_args(argv)
    try:
        out = generate(args.kind, args.out or f"data/synth_{args.kind}", args.count, args.seed, parse_size(args.size),
                       args.workers or None, args.vis, args.force, args.segmentation)
    except (ValueError, FileExistsError) as e:
        print(one_line(e), file=sys.stderr)
        return 2
    except ImportError as e:
        print(one_line(f"{e}: pip install 'd2export[synth]' (OpenCV draws the sets)"), file=sys.stderr)
        return 2
    n = len(json.loads((out / ANNOTATIONS).read_text())["annotations"])
    print(f"wrote {args.count} pictures and {n} labelled instances to {out}")
    return 0
