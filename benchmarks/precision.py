"""Served latency per precision, side by side: eager PyTorch, the float32 graph, int8 and bfloat16.

    .venv/bin/python tools/benchmark.py precision [--models micro r50 panoptic instance semantic] [--size 640]
        [--threads 2] [--rounds 3] [--precisions fp32 int8 int8-heads int8-openvino int8-heads-openvino bf16]
        [--pictures 4] [--out DIR]

One run, one machine. Per model (micro: the trained micro spotter, `textdet_micro`, read at its own 480; r50: the
R-50 TESTR-size spotter, `textdet`, seeded weights, read at --size; panoptic / instance / semantic: Mask2Former R-50
on the stand-in's full-size configs, seeded weights conditioned as the family says), each precision is exported as
`d2export export` writes it
(verification off: this times, `d2export export` and `d2export evaluate` verify and score):
- fp32: the fused sampler (the fastest float32 graph on the CPU), served by onnxruntime;
- int8: `export.int8=static` of that graph, calibrated on 8 synthetic pictures of a seed of its own
  (`d2export synth`: text for the spotters, boxes for the segmenters) at --size;
- int8-heads: the same with `export.int8_recipe=heads` (only the decoding heads float, convolutions int8: the
  recipe `verify.int8_accuracy` holds to accuracy on labelled pictures);
- int8-openvino, int8-heads-openvino: those two graphs served by OpenVINO (`export.runtime=openvino`);
- bf16: `export.bf16=true` of the fused graph, served by OpenVINO in bfloat16 with d2export's operator as its
  extension, where the CPU has AVX512-BF16 or AMX.
Then the runtime's Predictor (graph and served post-processing) of each and the model's own forward (list[dict] in,
its post-processing, MSDA on the plugin's pure-PyTorch core) are timed in interleaved rounds at --size², batch 1, the
same thread count everywhere. What each precision serves is taken against what float32 serves on --pictures
held-out pictures (a seed used nowhere else): words (multiset F-measure of the words shown) for the spotters; the
semantic map's mIoU, the panoptic map's PQ and instances matched at mask IoU 0.5 for the segmenters. Seeded weights
say nothing of a trained model's accuracy; the trained micro spotter's H-mean and word accuracy per precision are
`d2export evaluate --precision fp32,int8,bf16` (docs/precision.md).
"""
from __future__ import annotations

import collections
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.e2e import interleaved_rounds, paired_ratio
from benchmarks.segmentation import CONFIGS as SEGMENTATION_CONFIGS, _overrides as segmentation_overrides
from d2export.argparsing import parser

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"micro": ("textdet_micro", "text"), "r50": ("textdet", "text"), "panoptic": ("mask2former", "boxes"),
          "instance": ("mask2former", "boxes"), "semantic": ("mask2former", "boxes")}
PRECISIONS = {"fp32": ["export.sampler=fused"],
              "int8": ["export.sampler=fused", "export.int8=static", "export.calibration_count=8"],
              # only the decoding heads float, convolutions int8: what verify.int8_accuracy holds to accuracy
              "int8-heads": ["export.sampler=fused", "export.int8=static", "export.int8_recipe=heads",
                             "export.calibration_count=8"],
              "bf16": ["export.sampler=fused", "export.bf16=true"]}
# the int8 graphs served by OpenVINO (export.runtime=openvino: its int8 products, the float rest in float32)
PRECISIONS |= {f"{name}-openvino": [*PRECISIONS[name], "export.runtime=openvino"] for name in ("int8", "int8-heads")}
CALIBRATION_SEED, HELD_OUT_SEED, TIMED_SEED = 4101, 4102, 4103  # seeds of this benchmark's own


def _pictures(kind: str, folder: Path, count: int, seed: int, size: int) -> list[Path]:
    from d2export.datasets import generate

    if not (folder / "annotations.json").is_file():
        generate(kind, folder, count=count, seed=seed, size=(size, size), workers=1)
    return sorted((folder / "images").iterdir())


def _read(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _overrides(model: str, out: Path, size: int) -> list[str]:
    """The model's config keys; the sampler and the folder are the precision's. The R-50 spotter is read at --size
    (its config's test size is 1600); the micro spotter at its own (480, what it was trained for). Segmenters keep
    segmentation's thresholds for seeded weights (benchmarks/segmentation.py: the configs' 0.8 would serve empty
    panoptic maps)."""
    if model == "r50":
        return [f"model.opts=[INPUT.MIN_SIZE_TEST,{size},INPUT.MAX_SIZE_TEST,{size}]"]
    if model not in SEGMENTATION_CONFIGS:
        return []
    over = segmentation_overrides(None, model, out, "fused", 0.2, 0.0)
    return [o for o in over if not o.startswith(("export.output_dir=", "export.sampler="))]


def bf16_refusal() -> str | None:
    """Why bf16 is not measured here (None: it is)."""
    try:
        from d2export.runtime.openvino_session import Bf16Unavailable, require_bf16
    except ImportError as e:
        return f"OpenVINO is not installed ({e.name})"
    try:
        require_bf16(what="bfloat16", instead="its rows are left out")
    except Bf16Unavailable as e:
        return str(e)
    return None


# --- what each precision serves, against float32's -----------------------------------------------------------
def word_f(reference, other) -> float:
    """Multiset F-measure of the words two predictions show (1.0: the same words)."""
    a = collections.Counter(i.text for i in reference.instances if i.text)
    b = collections.Counter(i.text for i in other.instances if i.text)
    if not a and not b:
        return 1.0
    return 2 * sum((a & b).values()) / (sum(a.values()) + sum(b.values()))


def mean_iou(reference: np.ndarray, other: np.ndarray) -> float:
    """Mean over the classes either map holds of the two maps' IoU."""
    ious = [np.logical_and(reference == c, other == c).sum() / np.logical_or(reference == c, other == c).sum()
            for c in np.union1d(np.unique(reference), np.unique(other))]
    return float(np.mean(ious))


def instances_matched(reference, other, iou: float = 0.5) -> float:
    """Fraction of the reference's instances that the other has with the same label at mask IoU >= `iou`."""
    from d2export.instances import decode_mask

    theirs = [(i.label, decode_mask(i.mask)) for i in other.instances if i.mask is not None]
    mine = [(i.label, decode_mask(i.mask)) for i in reference.instances if i.mask is not None]
    if not mine:
        return 1.0 if not theirs else 0.0
    found = 0
    for label, mask in mine:
        found += any(lab == label and (mask & m).sum() / max((mask | m).sum(), 1) >= iou for lab, m in theirs)
    return found / len(mine)


def agreement(references: list, others: list) -> dict[str, float]:
    """What `others` serve against `references` (float32's), over the pictures."""
    from d2export.evaluating import panoptic_quality

    out = collections.defaultdict(list)
    stats, categories = {}, {}
    for ref, oth in zip(references, others):
        if ref.semantic is not None:
            out["mIoU"].append(mean_iou(ref.semantic, oth.semantic))
        if ref.panoptic is not None:
            segments = lambda p: [{"id": s.id, "category_id": s.category_id} for s in p.segments or []]  # noqa: E731
            stats = panoptic_quality.accumulate(stats, panoptic_quality.count(ref.panoptic, segments(ref),
                                                                              oth.panoptic, segments(oth)))
            categories |= {s.category_id: s.isthing for p in (ref, oth) for s in p.segments or []}
        elif any(i.mask is not None for i in ref.instances + oth.instances):
            out["instances@0.5"].append(instances_matched(ref, oth))
        if any(i.text for i in ref.instances + oth.instances):
            out["words F"].append(word_f(ref, oth))
    summary = {k: 100 * float(np.mean(v)) for k, v in out.items()}
    if categories:
        summary["PQ"] = panoptic_quality.summary(stats, categories)["PQ"]
    return summary


# --- one model ------------------------------------------------------------------------------------------------
def measure(model: str, precisions: list[str], size: int, threads: int, rounds: int, pictures: int,
            out: Path) -> dict:
    import torch

    from d2export import pipeline
    from d2export.config import load
    from d2export.runtime.predictor import Predictor

    config, kind = MODELS[model]
    base = _overrides(model, out / model, size)
    calibration = out / f"calibration_{kind}_{size}"
    _pictures(kind, calibration, 8, CALIBRATION_SEED, size)
    held_out = [_read(p) for p in _pictures(kind, out / f"held_out_{kind}_{size}", pictures, HELD_OUT_SEED, size)]
    timed = _read(_pictures(kind, out / f"timed_{kind}_{size}", 1, TIMED_SEED, size)[0])
    predictors, built = {}, None
    for precision in precisions:
        cfg = load(config, [*base, *PRECISIONS[precision], f"export.output_dir={out / model / precision}",
                            f"export.calibration={calibration}", "verify.enabled=false", "export.lint=false"])
        built = pipeline.prepare(cfg, ROOT) if built is None else built
        manifest = pipeline.export(cfg, built=_with_config(built, cfg))
        predictors[precision] = Predictor(out / model / precision / manifest.model_file, threads=threads)
    prepared = next(iter(predictors.values())).prepare(timed)
    inputs = [{"image": torch.from_numpy(prepared.chw).float(), "height": size, "width": size}]

    def eager():
        with torch.no_grad():
            built.model(inputs)

    runners = {"eager": eager} | {p: (lambda pr=pr: pr.predict(timed)) for p, pr in predictors.items()}
    times = interleaved_rounds(runners, rounds, warmup=1)
    served = {p: [pr.predict(picture) for picture in held_out] for p, pr in predictors.items()}
    reference = served.get("fp32")
    return {"times": times, "agreement": {p: agreement(reference, s) for p, s in served.items()} if reference else {}}


def _ratio(times: dict, over: str, under: str) -> str:
    median, low, high = paired_ratio(times, over, under)
    return f"{median:5.2f}x ({low:.2f}-{high:.2f})"


def _with_config(built, cfg):
    import dataclasses

    return dataclasses.replace(built, cfg=cfg)


def main(argv=None) -> int:
    ap = parser("benchmark.py precision", __doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                    help="micro and r50: the text spotters; panoptic, instance, semantic: Mask2Former R-50")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS),
                    help="bf16 only where the CPU has AVX512-BF16 or AMX (else said and skipped)")
    ap.add_argument("--size", type=int, default=640, help="square picture side")
    ap.add_argument("--threads", type=int, default=2, help="torch, onnxruntime and OpenVINO threads")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--pictures", type=int, default=4, help="held-out pictures the served results are compared on")
    ap.add_argument("--out", help="keep the graphs and pictures here (default: a temporary directory)")
    args = ap.parse_args(argv)

    import torch

    from d2export.cpu import describe_cpu

    torch.set_num_threads(args.threads)
    precisions = list(args.precisions)
    refusal = bf16_refusal() if "bf16" in precisions else None
    if refusal:
        precisions.remove("bf16")
    print(f"# d2export precision: {args.size}x{args.size}, batch 1, {args.threads} thread(s) everywhere; "
          f"torch {torch.__version__}; {describe_cpu()}")
    if refusal:
        print(f"bf16: not measured: {refusal}")
    holder = None if args.out else tempfile.TemporaryDirectory(prefix="d2export_precision_")
    out = Path(args.out or holder.name)
    print("ratios: the median of the rounds' own ratios (the range across rounds in brackets)")
    width = max(map(len, ["precision", *precisions]))
    print(f"\n{'model':10s} {'precision':{width}s} {'ms':>8s} {'x float32':>19s} {'x eager':>19s}   "
          "served vs float32's")
    for model in args.models:
        result = measure(model, precisions, args.size, args.threads, args.rounds, args.pictures, out)
        times = result["times"]
        for name, seconds in times.items():
            vs32 = _ratio(times, "fp32", name) if "fp32" in times else f"{'-':>19s}"
            said = ", ".join(f"{k} {v:.1f}" for k, v in result["agreement"].get(name, {}).items())
            print(f"{model:10s} {name:{width}s} {1000 * statistics.median(seconds):8.0f} {vs32} "
                  f"{_ratio(times, 'eager', name)}   {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
