"""`d2export evaluate`: a dataset's accuracy under PyTorch and under each exported model, side by side.

    d2export evaluate MODEL [MODEL …] --dataset NAME|FOLDER [--config CFG [overrides …]] [--max-images N]
        [--evaluator text|coco|segmentation|module:Class] [--vis DIR] [--json FILE]

Exit status 0 when it ran (whatever the metrics say), 2 on bad input.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from d2export.evaluating.labelled_sets import EvaluateError, dataset_records, json_dataset, registered_dataset

WORST = 5


# the models -----------------------------------------------------------------------------------------------------
def model_file(given: str) -> Path:
    """A model folder (one .onnx with its manifest inside) or the .onnx file itself."""
    from d2export.manifest import manifest_path

    path = Path(given)
    if path.is_dir():
        found = sorted(p for p in path.glob("*.onnx") if manifest_path(p).is_file())
        if len(found) != 1:
            raise EvaluateError(f"{given}: expected one exported model (an .onnx with its manifest), found "
                                f"{len(found)}")
        return found[0]
    if path.suffix == ".onnx" and path.is_file():
        return path
    raise EvaluateError(f"{given}: not an exported model folder or .onnx file")


def check_family(path: Path, family) -> None:
    from d2export.families import get
    from d2export.manifest import Manifest, manifest_path

    theirs = get(Manifest.read(manifest_path(path)).family)
    if theirs.name != family.name:
        raise EvaluateError(f"{path} is a {theirs.name} model, but --config builds a {family.name} model")


# the report -----------------------------------------------------------------------------------------------------
def table(runs, reference) -> str:
    names = list(dict.fromkeys(k for r in runs for k in r.metrics))
    heads = ["metric"] + [r.label if r is not reference else r.name for r in runs]
    heads += [f"Δ {r.name}" for r in runs if r is not reference]
    rows = []
    for k in names:
        base = reference.metrics.get(k, float("nan"))
        row = [k] + [f"{r.metrics.get(k, float('nan')):.2f}" for r in runs]
        row += [f"{r.metrics.get(k, float('nan')) - base:+.2f}" for r in runs if r is not reference]
        rows.append(row)
    rows.append(["ms/picture (median)"] + [f"{r.latency_ms:.1f}" for r in runs]
                + [f"{r.latency_ms / reference.latency_ms:.2f}x" for r in runs if r is not reference])
    rows.append(["CPU threads"] + [str(r.threads) for r in runs] + ["" for r in runs if r is not reference])
    widths = [max(len(str(c)) for c in col) for col in zip(heads, *rows)]
    fmt = lambda cells: "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(heads), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def compare(reference, run, records) -> dict[str, Any]:
    """The pictures where `run` found something else than `reference`, the worst first."""
    from d2export.evaluating.runs import difference

    found = []
    for i, (a, b) in enumerate(zip(reference.predictions, run.predictions)):
        d = difference(a, b)
        if d:
            found.append((d[0], i, d[1]))
    found.sort(key=lambda t: (-t[0], t[1]))
    return {"against": reference.name, "differing_pictures": len(found), "pictures": len(records),
            "worst": [{"index": i, "picture": records[i]["file_name"], "difference": what}
                      for _, i, what in found[:WORST]]}


def write_vis(folder: Path, reference, run, comparison: dict) -> list[Path]:
    """`reference | run` pictures of the worst pictures: folder/<run>/<picture>.png."""
    from d2export.runtime.image_decoding import read_image
    from d2export.runtime.visualize import draw_prediction, side_by_side

    written = []
    for w in comparison["worst"]:
        i = w["index"]
        image = read_image(w["picture"])
        pair = side_by_side([draw_prediction(image, reference.predictions[i], title=reference.name),
                             draw_prediction(image, run.predictions[i], title=f"{run.name} ({run.precision})")])
        out = folder / run.name / (Path(w["picture"]).stem + ".png")
        out.parent.mkdir(parents=True, exist_ok=True)
        pair.save(out)
        written.append(out)
    return written


PRECISIONS = {"fp32": [], "fp16": ["export.fp16=true"], "int8": ["export.int8=dynamic"],
              "int8-static": ["export.int8=static"],  # needs export.calibration=FOLDER among the overrides
              # needs export.calibration=FOLDER and verify.int8_accuracy=FOLDER (other pictures) among the overrides
              "int8-heads": ["export.int8=static", "export.int8_recipe=heads"],
              # the same two served by OpenVINO (its int8 products; faster on the AMX Xeon, docs/precision.md)
              "int8-openvino": ["export.int8=static", "export.runtime=openvino"],
              "int8-heads-openvino": ["export.int8=static", "export.int8_recipe=heads", "export.runtime=openvino"],
              "bf16": ["export.bf16=true", "export.sampler=fused"]}  # OpenVINO, where the CPU has bfloat16
# the first of these every run reports is drawn
PLOTTED = ("bbox/AP", "text/e2e_hmean", "text/det_hmean", "panoptic_seg/PQ", "sem_seg/mIoU", "segm/AP")


def export_precisions(config: str, overrides: Sequence[str], precisions: Sequence[str], root: Path) -> list[Path]:
    """The config exported at each precision (each verified as `d2export export` verifies it): root/<precision>."""
    from d2export import pipeline
    from d2export.config import load

    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise EvaluateError(f"--precision {','.join(unknown)}: choose from {', '.join(PRECISIONS)}")
    paths = []
    for precision in precisions:
        out = root / precision
        manifest = pipeline.export(load(config, [*overrides, *PRECISIONS[precision], f"export.output_dir={out}"]))
        paths.append(out / manifest.model_file)
    return paths


def plot(path: Path, runs) -> Path:
    """Accuracy against latency, one point per run: what each precision costs and what it buys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next((m for m in PLOTTED if all(m in r.metrics for r in runs)), None)
    if metric is None:
        raise EvaluateError(f"--plot: the runs share none of {', '.join(PLOTTED)}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ax.scatter(r.latency_ms, r.metrics[metric], s=40)
        ax.annotate(r.label, (r.latency_ms, r.metrics[metric]), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    ax.set_xlabel(f"ms per picture (median, {runs[0].threads} CPU threads)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def atomic_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# the command ----------------------------------------------------------------------------------------------------
def evaluate(models: Sequence[str], dataset: str | None = None, config: str | None = None,
             overrides: Sequence[str] = (), coco_json: str | None = None, image_root: str | None = None,
             evaluator: str | None = None, imports: Sequence[str] = (), max_images: int | None = None,
             providers: Sequence[str] = ("cpu",), vis: str | None = None, json_path: str | None = None,
             precisions: Sequence[str] = (), threads: int = 0, plot_path: str | None = None) -> dict:
    """Everything `d2export evaluate` does; returns the report (also written to `json_path`). `precisions`: also
    export --config at each (PRECISIONS) and evaluate those; `threads`: CPU threads for every run (0: torch's
    count)."""
    import importlib

    from d2export import families
    from d2export.cpu import describe_cpu
    from d2export.evaluating import intervals
    from d2export.evaluating.evaluators import build_evaluator, evaluation_tasks
    from d2export.evaluating.runs import onnx_run, pytorch_run
    from d2export.manifest import Manifest, manifest_path

    import torch

    if precisions and not config:
        raise EvaluateError("--precision exports --config at each precision: give --config")
    if not models and not config:
        raise EvaluateError("nothing to evaluate: give exported models, --config, or both")
    paths = [model_file(m) for m in models]
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # PyTorch and onnxruntime on as many threads: their latencies compare
    with tempfile.TemporaryDirectory(prefix="d2export-evaluate-") as tmp:
        # the dataset first: a model built for it reads its metadata (class names, thing ids) as it is built; the
        # config's stand-ins before any import, as export has them
        cfg = None
        if config:
            from d2export.config import load
            from d2export.patching import compiled_ops

            cfg = load(config, [*overrides, f"export.output_dir={tmp}"])
            compiled_ops.install(cfg.plugin.compiled_ops, cfg.plugin.import_only)
        for name in imports:
            importlib.import_module(name)
        if coco_json or image_root:
            if not (coco_json and image_root):
                raise EvaluateError("--coco-json and --image-root go together")
            name = json_dataset(coco_json, image_root, dataset)
        elif dataset:
            name = registered_dataset(dataset)
        else:
            raise EvaluateError("which pictures? give --dataset NAME|FOLDER or --coco-json FILE --image-root DIR")
        records = dataset_records(name, max_images)
        if precisions:
            paths += export_precisions(config, overrides, precisions, Path(tmp) / "exported")
        built = None
        if cfg is not None:
            from d2export import pipeline

            built = pipeline.prepare(cfg)
            for path in paths:
                check_family(path, built.family)
        manifests = [Manifest.read(manifest_path(p)) for p in paths]
        family = built.family if built else families.get(manifests[0].family)
        kind = evaluator or family.evaluator
        outputs = set(built.adapter.output_names) if built else {t.name for m in manifests for t in m.outputs}
        tasks = evaluation_tasks(kind, name, outputs)
        ids = [r["image_id"] for r in records]
        d2cfg = built.d2cfg if built else None

        def make(post: dict):
            return build_evaluator(kind, name, post, tasks, d2cfg, tmp, ids)

        runs = []
        with contextlib.redirect_stdout(sys.stderr):  # pycocotools prints its tables: stdout keeps the report
            if built:
                post = family.postprocess(d2cfg) | built.charset
                runs.append(pytorch_run(built.model, records, make(post), family.preprocess(d2cfg), post))
            for path in paths:
                runs.append(onnx_run(path, records, make, providers, threads))
    reference = runs[0]
    report = {"dataset": name, "pictures": len(records), "evaluator": kind, "tasks": list(tasks),
              "runs": [{"name": r.name, "precision": r.precision, "model": r.model, "metrics": r.metrics,
                        "latency_ms": r.latency_ms, "threads": r.threads, "runtime": r.runtime} for r in runs],
              "cpu": describe_cpu(),
              "comparisons": [compare(reference, r, records) for r in runs[1:]]}
    print(table(runs, reference))
    found = intervals.measures(kind, name, tasks, reference.metrics) if len(runs) > 1 else []
    if found:  # how sure each difference is (intervals.py)
        stats = [intervals.statistics(found, r, records) for r in runs]
        for c, r, own in zip(report["comparisons"], runs[1:], stats[1:]):
            c["intervals"] = intervals.compared(found, stats[0], own)
            print(intervals.line(r.name, c["intervals"], len(records)))
    for c, r in zip(report["comparisons"], runs[1:]):
        print(f"{r.name}: {c['differing_pictures']} of {c['pictures']} pictures differ from {c['against']}"
              + "".join(f"\n  {Path(w['picture']).name}: {w['difference']}" for w in c["worst"]))
        if vis:
            write_vis(Path(vis), reference, r, c)
    if plot_path:
        print(f"plot: {plot(Path(plot_path), runs)}")
    if json_path:
        atomic_json(Path(json_path), report)
    return report


def evaluate_main(argv: list[str] | None = None) -> int:
    from d2export.argparsing import export_side_missing, one_line, parser

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser("d2export evaluate", "Evaluate a dataset under PyTorch (--config) and each exported model, side by "
                "side: the evaluator's metrics, their deltas, and the pictures whose detections differ.",
                "examples:\n"
                "  d2export evaluate outputs/textdet/run1 --dataset data/synth_text --config textdet\n"
                "  d2export evaluate fp32/ fp16/ --coco-json val.json --image-root val/ --max-images 200\n"
                "  d2export evaluate --config rcnn_tiny --dataset my_val --imports my_project.datasets\n"
                "  d2export evaluate --config textdet_micro --dataset held/ --precision fp32,fp16,int8 --plot p.png")
    ap.add_argument("items", nargs="*", metavar="MODEL|OVERRIDE",
                    help="exported models (folders or .onnx files), and config overrides (key=value) for --config")
    ap.add_argument("--dataset", default=None, help="a name in detectron2's DatasetCatalog or a folder `d2export "
                    "synth` wrote; with --coco-json, the name to register it under (default: none)")
    ap.add_argument("--coco-json", default=None, metavar="FILE", help="a COCO JSON to evaluate on (default: none)")
    ap.add_argument("--image-root", default=None, metavar="DIR", help="its pictures (default: none)")
    ap.add_argument("--config", default=None, help="also run the PyTorch model as `d2export export --config` builds "
                    "it (default: exported models only)")
    ap.add_argument("--evaluator", default=None, help="text, coco, segmentation (mIoU, PQ, mask AP), or "
                    "module:Class (a detectron2 DatasetEvaluator of yours) (default: the model family's)")
    ap.add_argument("--imports", default="", help="comma-separated modules to import first, e.g. the one that "
                    "registers your dataset (default: none)")
    ap.add_argument("--max-images", type=int, default=0, help="evaluate the first N pictures (default: 0, all)")
    ap.add_argument("--providers", default="cpu", help="onnxruntime execution providers, comma-separated")
    ap.add_argument("--vis", default=None, metavar="DIR", help="write reference | model pictures of the worst "
                    "differing pictures there (default: none)")
    ap.add_argument("--precision", default="", help="with --config: also export it at each of these precisions "
                    "and evaluate them, comma-separated: fp32, fp16, int8 (dynamic), int8-static (give "
                    "export.calibration=FOLDER), int8-heads (int8-static with export.int8_recipe=heads: give "
                    "verify.int8_accuracy=FOLDER too), int8-openvino and int8-heads-openvino (those two served by "
                    "OpenVINO), bf16 (OpenVINO, on a CPU with AVX512-BF16 or AMX) (default: none)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of every run, PyTorch and onnxruntime "
                    "alike (default: 0, torch's count)")
    ap.add_argument("--plot", default=None, metavar="FILE", help="draw accuracy against latency there (default: "
                    "none)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON (default: none)")
    ap.add_argument("--traceback", "--verbose", action="store_true", help="show full tracebacks on errors")
    args = ap.parse_args(argv)
    overrides = [i for i in args.items if "=" in i]
    models = [i for i in args.items if "=" not in i]
    if overrides and not args.config:
        print(one_line(f"overrides {' '.join(overrides)} need --config"), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from d2export.building import quiet_imports

    try:
        with quiet_imports():
                evaluate(models, args.dataset, args.config, overrides, args.coco_json, args.image_root, args.evaluator,
                     [m for m in args.imports.split(",") if m], args.max_images or None, args.providers.split(","),
                     args.vis, args.json, [p for p in args.precision.split(",") if p], args.threads, args.plot)
    except Exception as e:  # noqa: BLE001 - one line unless --traceback
        if args.traceback:
            raise
        print(export_side_missing(e, "evaluate") or one_line(e), file=sys.stderr)
        return 2
    return 0
