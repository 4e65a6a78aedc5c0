"""export.bf16: the verified float32 graph, unchanged, verified again as OpenVINO serves it in bfloat16 against eager
float32, with bfloat16's own tolerances (`verify.bf16_*`) and the top-K agreement, confident detections and near-tie
pinning float16 and int8 use (reduced_precision.py); the pinning reads the graph's selections as OpenVINO computes
them in bfloat16 too."""
from __future__ import annotations

import logging

from d2export import progress
from d2export.verification import comparison
from d2export.verification.reduced_precision import verify_as_served
from d2export.verification.subject import Subject

log = logging.getLogger("d2export")


def verify_bfloat16(subject: Subject) -> dict:
    """The staged float32 graph served by OpenVINO in bfloat16 on as many threads as the eager references, verified
    on the float32 verification's cases; the summary (with what served it), or VerificationError. With
    `verify.bf16_accuracy`, held to the float32 graph's accuracy on those labelled pictures instead
    (held_out_accuracy.py), the tensors' verdict recorded beside it. On a CPU without bfloat16 instructions,
    Bf16Unavailable (config.resolve refuses that before anything is built)."""
    import torch

    if not subject.cases:
        return {"passed": None}
    threads = torch.get_num_threads()
    served = {"runtime": "openvino"}
    if subject.built.cfg.verify.bf16_accuracy:
        accuracy = _held_to_accuracy(subject)
        try:  # recorded: what users receive was judged above
            tensors = _verify_tensors(subject, threads)
        except comparison.VerificationError as refusal:
            tensors = {"passed": False, "refusal": str(refusal).splitlines()[0]}
            log.info("bfloat16 tensors past verify.bf16_* (recorded; accuracy judges this graph): %s",
                     tensors["refusal"])
        return {"passed": True, "judged_by": "accuracy", "accuracy": accuracy, "tensors": tensors} | served
    return _verify_tensors(subject, threads) | served


def _verify_tensors(subject: Subject, threads: int) -> dict:
    progress.step(5, "verifying as served in bfloat16", f"OpenVINO, INFERENCE_PRECISION_HINT=bf16, {threads} threads")
    return verify_as_served(subject, "bfloat16")


def _held_to_accuracy(subject: Subject) -> dict:
    """The float32 graph (onnxruntime) and the same graph in bfloat16 (OpenVINO), served over verify.bf16_accuracy's
    pictures and scored alike; AccuracyError where a headline metric drops more than verify.bf16_max_drop."""
    from d2export.verification import held_out_accuracy  # detectron2's evaluation, imported when asked for

    held = held_out_accuracy.held_out(subject, "bf16")
    where = f"{len(held.records)} labelled pictures of {held.dataset}"
    progress.step(5, "scoring the float32 graph", where)
    reference = held_out_accuracy.served_run(subject, held, subject.path, "float32")
    progress.step(5, "scoring the graph in bfloat16", where)
    bf16 = held_out_accuracy.served_run(subject, held, subject.path, "bfloat16")
    return held_out_accuracy.judge(reference, bf16, subject.built.cfg.verify.bf16_max_drop, held)
