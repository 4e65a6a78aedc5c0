"""A reduced-precision graph (int8, bfloat16) held to the float32 graph's accuracy on labelled held-out pictures
(`verify.int8_accuracy`, `verify.bf16_accuracy`): both are served through the runtime's Predictor, as users receive
them, and scored by the family's evaluator (the one `d2export evaluate` uses); each headline metric may drop at most
`verify.<precision>_max_drop` points. What users receive is judged here, not tensors: a graph whose scores move past
its precision's tolerances while its words, boxes and masks hold is served, and one that loses accuracy is refused,
whatever its tensors say."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from d2export.evaluating.evaluators import HEADLINE, build_evaluator, evaluation_tasks
from d2export.evaluating.labelled_sets import EvaluateError, dataset_records, registered_dataset
from d2export.evaluating.runs import Run, onnx_run
from d2export.manifest import manifest_path
from d2export.verification.comparison import VerificationError
from d2export.verification.subject import Subject

log = logging.getLogger("d2export")


class AccuracyError(VerificationError):
    """The reduced-precision graph serves less accurately than the float32 graph, or the pictures cannot tell."""


@dataclass
class HeldOut:
    """The labelled pictures and how they are scored."""

    dataset: str  # its name in detectron2's DatasetCatalog
    records: list
    evaluator: str  # the family's: text, coco or segmentation
    tasks: tuple
    key: str = "int8"  # the verify.* keys that gave the pictures and the drop: verify.<key>_accuracy, _max_drop


def held_out(subject: Subject, key: str = "int8") -> HeldOut:
    """`verify.<key>_accuracy`'s pictures (key: "int8" or "bf16"), loaded and checked before the long part."""
    built, given = subject.built, getattr(subject.built.cfg.verify, f"{key}_accuracy")
    try:
        name = registered_dataset(given)
        records = dataset_records(name, None)
        tasks = evaluation_tasks(built.family.evaluator, name, set(built.adapter.output_names))
    except (EvaluateError, ValueError) as e:
        raise AccuracyError(f"verify.{key}_accuracy={given}: {e}") from None
    return HeldOut(name, records, built.family.evaluator, tasks, key)


def served_run(subject: Subject, held: HeldOut, graph: Path, precision: str) -> Run:
    """`graph` served as users receive it (the runtime's Predictor with the manifest it would be written with) over
    the pictures, scored by the family's evaluator, on as many threads as the eager references."""
    import torch

    built = subject.built
    with tempfile.TemporaryDirectory(prefix="d2export-accuracy-") as tmp:
        model = Path(tmp) / "model.onnx"
        try:
            os.link(graph, model)  # the staged graph itself, not a copy
        except OSError:
            shutil.copyfile(graph, model)
        subject.served_manifest(model, precision).write(manifest_path(model))

        def make(post: dict):
            return build_evaluator(held.evaluator, held.dataset, post, held.tasks, built.d2cfg, tmp,
                                   [r["image_id"] for r in held.records])

        try:
            with contextlib.redirect_stdout(sys.stderr):  # pycocotools prints its tables
                run = onnx_run(model, held.records, make, built.cfg.verify.providers, torch.get_num_threads(),
                               verify_hash=False)
        except ValueError as e:  # the evaluator's word on pictures that do not fit the model (its classes)
            given = getattr(built.cfg.verify, f"{held.key}_accuracy")
            raise AccuracyError(f"verify.{held.key}_accuracy={given}: {e}") from None
    run.name = precision
    return run


def _intervals(reference: Run, run: Run, held: HeldOut) -> dict[str, dict[str, float]]:
    """The paired bootstrap's interval of each difference (evaluating/intervals.py), for the figures that have one
    (text, mIoU, PQ), where both runs kept their predictions; else none."""
    if not len(held.records) == len(reference.predictions) == len(run.predictions):
        return {}
    from d2export.evaluating import intervals

    found = intervals.measures(held.evaluator, held.dataset, held.tasks, reference.metrics)
    return intervals.compared(found, *(intervals.statistics(found, r, held.records) for r in (reference, run)))


def _interval_said(row: dict) -> str:
    return f"  95% interval [{row['interval'][0]:+.2f}, {row['interval'][1]:+.2f}]" if "interval" in row else ""


def _pictures_to_rule_out(row: dict, pictures: int, max_drop: float) -> float:
    """How many pictures would bring the interval's low end inside -max_drop, the difference staying where it is
    (a bootstrap interval narrows as one over the square root of the pictures); inf for a difference at the bound."""
    below, room = -row["drop"] - row["interval"][0], max_drop - row["drop"]  # under the difference; to the bound
    return math.ceil(pictures * (below / room) ** 2) if room > 0 else math.inf


def judge(reference: Run, run: Run, max_drop: float, held: HeldOut) -> dict:
    """The record of `run`'s headline metrics against `reference`'s (the float32 graph's on the same pictures), or
    AccuracyError where one dropped more than `max_drop` points, or where the pictures cannot tell a right graph
    from a wrong one (no headline metric, or the float32 graph scoring nothing)."""
    where = f"{held.dataset} ({len(held.records)} pictures)"
    headline = [m for m in HEADLINE if m in reference.metrics]
    if not headline:
        raise AccuracyError(f"verify.{held.key}_accuracy: the {held.evaluator} evaluator gave none of "
                            f"{', '.join(HEADLINE)} on {where}: give pictures labelled for this model")
    if not any(reference.metrics[m] > 0 for m in headline):
        raise AccuracyError(f"verify.{held.key}_accuracy: the float32 graph scores 0 on {where} "
                            f"({', '.join(headline)}): those pictures cannot tell a right {run.precision} graph from "
                            "a wrong one")
    rows = {m: {"float32": reference.metrics[m], run.precision: run.metrics.get(m, float("nan")),
                "drop": reference.metrics[m] - run.metrics.get(m, float("nan"))} for m in headline}
    for m, found in _intervals(reference, run, held).items():  # how sure each difference is: said, not judged
        rows[m]["interval"] = [found["low"], found["high"]]
    lost = [m for m, r in rows.items() if not r["drop"] <= max_drop]  # NaN: lost too
    past = f"  past verify.{held.key}_max_drop"
    table = "\n".join(f"  {m:<16} float32 {r['float32']:6.2f}  {run.precision} {r[run.precision]:6.2f}  "
                      f"{-r['drop']:+6.2f}{_interval_said(r)}{past if m in lost else ''}" for m, r in rows.items())
    if lost:
        raise AccuracyError(f"the {run.precision} graph serves less accurately than the float32 graph on {where}: "
                            f"{', '.join(lost)} dropped more than verify.{held.key}_max_drop={max_drop:g} "
                            f"point(s)\n{table}")
    log.info("%s held to accuracy on %s (at most %g point(s) lost):\n%s", run.precision, where, max_drop, table)
    unsure = [m for m, r in rows.items() if "interval" in r and r["interval"][0] < -max_drop]
    if unsure:
        needed = max(_pictures_to_rule_out(rows[m], len(held.records), max_drop) for m in unsure)
        reaches = ", ".join(f"{m} down to {rows[m]['interval'][0]:+.2f}" for m in unsure)
        log.warning("%s: these %d pictures cannot rule out a loss past %g point(s) (%s): %s", run.precision,
                    len(held.records), max_drop, reaches,
                    "no number of pictures would, the difference being at the bound" if math.isinf(needed) else
                    f"about {needed} labelled pictures would, if the difference stays where it is")
    return {"passed": True, "dataset": held.dataset, "pictures": len(held.records), "evaluator": held.evaluator,
            "max_drop": max_drop, "metrics": rows}

