"""Mask2Former-style segmenters: the exported graph and its served results against the model's own eager path.

    .venv/bin/python tools/benchmark.py segmentation [--clone /src/Mask2Former] [--tasks panoptic instance semantic]
        [--sizes 320x320 480x640 640x480] [--batch 320x320 400x256] [--size 640] [--threads 2] [--rounds 3]
        [--samplers gather fused] [--postprocess-graph] [--device cuda] [--batches 1 8] [--object-mask-threshold 0.2]
        [--overlap-threshold 0] [--out DIR]

Without --clone, the stand-in of third_party/mask2former (its full-size configs). One run, one machine:
1. per task's config (COCO panoptic, COCO instance, ADE20K semantic on R-50; `--tasks panoptic-swin`: COCO panoptic
   on Swin-T; seeded random weights, conditioned as the family says): export and verify as `tools/export.py
   --config mask2former` does, with the first sampler;
2. parity at each of --sizes and a --batch of two, graph against the model's own forward (list[dict] in, its
   ImageList padding, its post-processing): class probabilities, mask probabilities, and the served semantic map
   (d2export/families/_mask_predictions.py on the graph's outputs) against the model's `sem_seg` argmax pixel for
   pixel, the pixels that differ counted with those whose two best class scores lie within 1e-4 of each other (ties
   float noise may break either way);
3. post-processing alone: the served semantic, panoptic and instance results computed from the model's own head
   outputs against the model's own results from the same forward (equal, or the largest difference);
4. latency at --size², batch 1, interleaved rounds, medians: eager PyTorch (the model as detectron2's DefaultPredictor
   runs it: the config's test resize, post-processing to the original size) against the runtime's Predictor (graph +
   served post-processing) per sampler, the served time split into graph and post-processing; ratios (each the
   median of the rounds' own ratios). Each of --size by each of --batches; `--device cuda`: eager on the GPU
   against the CUDA provider (benchmarks/gpu_session.sh).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import interleaved_rounds, paired_ratio
from d2export.argparsing import parser

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"panoptic": "configs/coco/panoptic-segmentation/maskformer2_R50_bs16_50ep.yaml",
           "instance": "configs/coco/instance-segmentation/maskformer2_R50_bs16_50ep.yaml",
           "semantic": "configs/ade20k/semantic-segmentation/maskformer2_R50_bs16_160k.yaml",
           # COCO panoptic on Swin-T (window 7), the same path in upstream's clone; not in the default --tasks
           "panoptic-swin": "configs/coco/panoptic-segmentation/swin/maskformer2_swin_tiny_bs16_50ep.yaml"}
TIE = 1e-4  # two best class scores this close: a pixel whose class float noise may decide


def _size(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    return int(h), int(w)


def _overrides(clone: Path | None, task: str, out: Path, sampler: str, keep: float, overlap: float) -> list[str]:
    root = clone or ROOT / "third_party" / "mask2former"
    over = [f"model.d2_config={root / CONFIGS[task]}", f"export.output_dir={out}", f"export.sampler={sampler}",
            f"model.opts=[MODEL.MASK_FORMER.TEST.OBJECT_MASK_THRESHOLD,{keep},"
            f"MODEL.MASK_FORMER.TEST.OVERLAP_THRESHOLD,{overlap}]"]
    return over + ([f"model.sys_path=[{clone}]"] if clone else [])


def _images(sizes, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (3, h, w), dtype=np.uint8) for h, w in sizes]


def own_forward(model, images) -> tuple[list[dict], dict]:
    """The model's own forward on list[dict]: its results, and its head's outputs (captured as it hands them on)."""
    import torch

    seen = []
    hook = model.sem_seg_head.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            results = model([{"image": torch.from_numpy(im).float()} for im in images])
    finally:
        hook.remove()
    return results, {k: seen[-1][k].numpy() for k in ("pred_logits", "pred_masks")}


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def parity(model, session, adapter, post, sizes, seed) -> dict:
    """Graph against the model's own forward on one batch."""
    from d2export.families._mask_predictions import mask_prediction

    images = _images(sizes, seed)
    results, head = own_forward(model, images)
    feeds = adapter.graph_inputs(images)
    graph = dict(zip(("pred_logits", "pred_masks"), session.run(None, feeds)))
    row = {"case": "+".join(f"{h}x{w}" for h, w in sizes),
           "class_prob": float(np.abs(_softmax(graph["pred_logits"]) - _softmax(head["pred_logits"])).max()),
           "mask_prob": float(np.abs(1 / (1 + np.exp(-graph["pred_masks"])) - 1 / (1 + np.exp(-head["pred_masks"])))
                              .max())}
    if post["semantic_on"]:
        differ = ties = total = 0
        for i, (h, w) in enumerate(sizes):
            served = mask_prediction(graph, i, (h, w), (h, w), post).semantic
            scores = results[i]["sem_seg"].numpy()
            top2 = np.sort(scores, 0)[-2:]
            off = served != scores.argmax(0)
            differ, total = differ + int(off.sum()), total + off.size
            ties += int((off & (top2[1] - top2[0] <= TIE)).sum())
        row |= {"semantic_pixels_differ": differ, "of_which_ties": ties, "pixels": total}
    return row


def postprocessing(model, post, sizes, seed) -> dict:
    """The served post-processing on the model's own head outputs against the model's own results."""
    from d2export.families._mask_predictions import mask_prediction
    from d2export.instances import decode_mask

    import torch

    images = _images(sizes, seed)
    seen = []  # what the model hands its own panoptic_inference (masks after its sem_seg_postprocess)
    if hasattr(model, "panoptic_inference"):
        own = model.panoptic_inference
        model.panoptic_inference = lambda cls, masks: seen.append((cls, masks)) or own(cls, masks)
    try:
        results, head = own_forward(model, images)
    finally:
        model.__dict__.pop("panoptic_inference", None)
    row = {"case": "+".join(f"{h}x{w}" for h, w in sizes)}
    for i, (h, w) in enumerate(sizes):
        served, own = mask_prediction(head, i, (h, w), (h, w), post), results[i]
        if "sem_seg" in own:
            row["semantic_equal"] = row.get("semantic_equal", True) and bool(
                np.array_equal(served.semantic, own["sem_seg"].argmax(0).numpy()))
        if "panoptic_seg" in own:
            ids, segments = own["panoptic_seg"]
            row["panoptic_equal"] = row.get("panoptic_equal", True) and bool(
                np.array_equal(served.panoptic, ids.numpy())
                and [(s.id, s.category_id, s.isthing) for s in served.segments]
                == [(s["id"], s["category_id"], s["isthing"]) for s in segments])
            row["segments"] = row.get("segments", 0) + len(segments)
            off = served.panoptic != ids.numpy()
            row["panoptic_pixels_differ"] = row.get("panoptic_pixels_differ", 0) + int(off.sum())
            if off.any():  # upstream's own two best products there: tied within 4 ulps, float noise decides
                cls, masks = seen[i]
                scores, labels = torch.softmax(cls, -1).max(-1)
                keep = (labels != post["num_classes"]) & (scores > post["object_mask_threshold"])
                top2 = (scores[keep].view(-1, 1, 1) * masks[keep].sigmoid()).topk(2, dim=0).values.numpy()
                tied = top2[0] - top2[1] <= 4 * np.spacing(top2[0])
                row["of_which_ties"] = row.get("of_which_ties", 0) + int((off & tied).sum())
        if "instances" in own:
            inst = own["instances"]
            order = np.argsort(-inst.scores.numpy(), kind="stable")
            mine = sorted(served.instances, key=lambda x: -x.score)
            same = len(mine) == len(inst) and [x.label for x in mine] == inst.pred_classes.numpy()[order].tolist()
            score = max((abs(x.score - s) for x, s in zip(mine, inst.scores.numpy()[order])), default=0.0)
            masks = all(np.array_equal(decode_mask(x.mask), m) for x, m in
                        zip(mine, inst.pred_masks.numpy()[order].astype(bool)))
            row["instances_equal"] = row.get("instances_equal", True) and bool(same and masks)
            row["instance_score_max_diff"] = max(row.get("instance_score_max_diff", 0.0), float(score))
    return row


def latency(model, predictors: dict, size: int, rounds: int, batch: int = 1,
            device: str = "cpu") -> dict[str, list[float]]:
    """Seconds of each call in interleaved rounds (`interleaved_rounds`), `batch` pictures of size² a call: the eager
    model as detectron2's DefaultPredictor runs it (the pictures resized as the config's test size says, the original
    size asked back) against each Predictor, and the served time split into the graph and the post-processing. On
    CUDA each eager call ends with a synchronize (the served one ends on the host)."""
    import torch

    hwcs = [np.ascontiguousarray(im.transpose(1, 2, 0)) for im in _images([(size, size)] * batch, 11)]
    first = next(iter(predictors.values()))
    prepared = [first.prepare(hwc) for hwc in hwcs]  # the Predictor's resize: both sides see the same pixels
    inputs = [{"image": torch.from_numpy(p.chw).float(), "height": size, "width": size} for p in prepared]

    def eager():
        model(inputs)
        if device == "cuda":
            torch.cuda.synchronize()

    runners = {"eager PyTorch (its forward, post-processing included)": eager}
    for s, p in predictors.items():
        runners[f"onnxruntime {s} + served post-processing"] = lambda p=p: p.predict_batch(hwcs)
        runners[f"  of which the graph ({s})"] = lambda p=p: p.run(prepared)
    outputs = first.run(prepared)
    runners["  of which the post-processing"] = lambda: [first.postprocess(outputs, i, p) for i, p in
                                                         enumerate(prepared)]
    with torch.no_grad():
        return interleaved_rounds(runners, rounds, warmup=1)


def compute_floor(adapter, predictor, size: int, threads: int) -> tuple[float, float]:
    """The graph's multiply-adds at size² (as the Predictor resizes it) and the seconds they take at the best float32
    rate measured here (benchmarks/e2e.py's counter and rate)."""
    import torch

    from benchmarks.e2e import dense_rate, model_macs

    feeds = predictor.feeds([predictor.prepare(np.zeros((size, size, 3), np.uint8))])
    macs = model_macs(adapter, tuple(torch.from_numpy(feeds[n]) for n in adapter.input_names))
    return macs, macs / dense_rate(threads)


def main(argv=None) -> int:
    ap = parser("benchmark.py segmentation", __doc__.split("\n\n")[0])
    ap.add_argument("--clone", type=Path, default=None, help="a Mask2Former checkout (default: the stand-in)")
    ap.add_argument("--tasks", nargs="+", default=["panoptic", "instance", "semantic"], choices=list(CONFIGS))
    ap.add_argument("--sizes", nargs="+", default=["320x320", "480x640", "640x480"])
    ap.add_argument("--batch", nargs=2, default=["320x320", "400x256"])
    ap.add_argument("--size", type=int, nargs="+", default=[640], help="latency: square picture sides")
    ap.add_argument("--batches", type=int, nargs="+", default=[1], help="latency: pictures a call")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="latency: eager on this device against the CUDA provider (parity stays on the CPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samplers", nargs="+", default=["gather", "fused"])
    ap.add_argument("--postprocess-graph", action="store_true",
                    help="also the last sampler's graph with export.postprocess=graph (its per-pixel work inside)")
    ap.add_argument("--object-mask-threshold", type=float, default=0.2,
                    help="panoptic: seeded weights score no query past the configs' 0.8, so their panoptic maps would "
                         "be empty; this keeps some")
    ap.add_argument("--overlap-threshold", type=float, default=0.0,
                    help="panoptic: seeded weights' masks all overlap, so the configs' 0.8 would drop every segment")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_segmentation")
    args = ap.parse_args(argv)

    import torch

    from d2export import pipeline
    from d2export.config import load
    from d2export.cpu import describe_cpu
    from d2export.runtime.predictor import Predictor

    torch.set_num_threads(args.threads)
    print(f"# {describe_cpu()}; {args.threads} threads; {'clone ' + str(args.clone) if args.clone else 'stand-in'}")
    report = {"cpu": describe_cpu(), "threads": args.threads, "tasks": {}}
    for task in args.tasks:
        predictors, built = {}, None
        runs = [(s, s, []) for s in args.samplers] + (  # (name, sampler, extra overrides)
            [(f"{args.samplers[-1]}, post-processing in the graph", args.samplers[-1], ["export.postprocess=graph"])]
            if args.postprocess_graph else [])
        for name, sampler, extra in runs:
            out = args.out / task / name.replace(", ", "_").replace(" ", "_")
            cfg = load("mask2former", _overrides(args.clone, task, out, sampler, args.object_mask_threshold,
                                                 args.overlap_threshold) + extra)
            built = pipeline.prepare(cfg, ROOT)
            start = time.perf_counter()
            manifest = pipeline.export(built.cfg, built=built)
            worst = max(manifest.verification["cases"], key=lambda c: c["max_abs"])
            print(f"{task} {name}: exported and verified in {time.perf_counter() - start:.0f} s "
                  f"({len({c['case'] for c in manifest.verification['cases']})} cases, largest difference "
                  f"{worst['output']} {worst['max_abs']:.2g})")
            predictors[name] = Predictor(out / manifest.model_file, [args.device], threads=args.threads)
        first = predictors[args.samplers[0]]
        rows = [parity(built.model, first.session, built.adapter, first.post, [_size(s)], 1) for s in args.sizes]
        rows.append(parity(built.model, first.session, built.adapter, first.post, [_size(s) for s in args.batch], 2))
        post_rows = [postprocessing(built.model, first.post, [_size(s) for s in args.batch], 3)]
        for row in rows + post_rows:
            print(f"  {task} {json.dumps(row)}")
        report["tasks"][task] = {"parity": rows, "postprocessing": post_rows, "latency_ms": {}}
        built.model.to(args.device)
        for size in args.size:
            for batch in args.batches:
                case = f"{size}², batch {batch}"
                times = latency(built.model, predictors, size, args.rounds, batch, args.device)
                ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
                first = next(iter(times))
                eager = ms[first]
                for name, t in ms.items():  # the speed-up: the median of each round's own ratio
                    speedup = "" if name.startswith(" ") else f"  {paired_ratio(times, first, name)[0]:5.2f}x"
                    print(f"  {task} {case}: {name:58s} {t:8.0f} ms{speedup}")
                report["tasks"][task]["latency_ms"][case] = ms
                if args.device == "cpu" and batch == 1:
                    macs, floor = compute_floor(built.adapter, first, size, args.threads)
                    print(f"  {task} {case}: compute floor of the graph {macs / 1e9:.0f} G multiply-adds at this "
                          f"machine's best float32 rate: {1e3 * floor:.0f} ms; with post-processing free, no float32 "
                          f"graph beats eager by more than {eager / (1e3 * floor):.2f}x")
                    report["tasks"][task] |= {"graph_macs": macs, "floor_ms": 1e3 * floor}
        built.model.to("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
