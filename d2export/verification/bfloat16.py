"""export.bf16: the verified float32 graph, unchanged, verified again as OpenVINO serves it in bfloat16 against eager
float32, with bfloat16's own tolerances (`verify.bf16_*`) and the top-K agreement, confident detections and near-tie
pinning float16 and int8 use (reduced_precision.py); the pinning reads the graph's selections as OpenVINO computes
them in bfloat16 too."""
from __future__ import annotations

from d2export import progress
from d2export.runtime import openvino_session
from d2export.verification import near_ties
from d2export.verification.reduced_precision import _verify_reduced
from d2export.verification.subject import Subject


def verify_bfloat16(subject: Subject) -> dict:
    """The staged float32 graph served by OpenVINO in bfloat16 on as many threads as the eager references, verified
    on the float32 verification's cases; the summary (with what served it), or VerificationError. On a CPU without
    bfloat16 instructions, Bf16Unavailable (config.resolve refuses that before anything is built)."""
    import torch

    if not subject.cases:
        return {"passed": None}
    threads = torch.get_num_threads()
    progress.step(5, "verifying as served in bfloat16", f"OpenVINO, INFERENCE_PRECISION_HINT=bf16, {threads} threads")
    session = openvino_session.OpenVINOSession(subject.path, "bf16", threads)
    copy = near_ties.SelectingCopy(subject.path,
                                   open_model=lambda model: openvino_session.open_model(model, "bf16", threads))
    return _verify_reduced(subject, "bfloat16", session, copy) | {"runtime": "openvino",
                                                                   "openvino": session.version}
