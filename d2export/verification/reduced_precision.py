"""A verified float32 graph converted to float16 or quantised to int8 in place, and verified against eager float32
with that precision's own tolerances (top-K agreement, confident detections)."""
from __future__ import annotations

import logging
from pathlib import Path

from d2export import progress
from d2export.verification import check_sessions, comparison, pinning
from d2export.verification.failed_cases import _pin_selections
from d2export.verification.pictures import picture_files
from d2export.verification.subject import Subject, served_manifest, serving_runtime
from d2export.verification.tolerances import _reduced_settings, reduced_tolerances

log = logging.getLogger("d2export")


def convert_to_float16(subject: Subject) -> dict:
    """The verified float32 graph → float16 in place, verified on the same cases with float16's own tolerances."""
    import onnx

    from d2export.exporting.fp16 import to_float16

    keep_io_types = subject.built.cfg.export.keep_io_types
    progress.step(5, "converting to float16", f"keep_io_types={keep_io_types}")
    onnx.save(to_float16(onnx.load(str(subject.path)), keep_io_types=keep_io_types,
                         fused=subject.built.cfg.export.fp16_fused), str(subject.path))
    return _verify_reduced(subject, "float16") if subject.cases else {"passed": None}


def quantise_to_int8(subject: Subject) -> dict:
    """The verified float32 graph → int8 in place (exporting/int8.py), verified with int8's own tolerances; or, with
    `verify.int8_accuracy`, held to the float32 graph's accuracy on those labelled pictures (held_out_accuracy.py),
    the tensors' verification recorded beside it."""
    from d2export.cpu import cpu_features
    from d2export.exporting import int8

    built, path, e = subject.built, subject.path, subject.built.cfg.export
    judged = bool(built.cfg.verify.int8_accuracy and subject.cases)
    scopes, static_ops = built.family.int8_float_scopes, built.family.int8_static_ops
    if e.int8_recipe == "heads":  # held to accuracy: only what decodes points and picks proposals stays float
        scopes = built.family.int8_head_scopes if built.family.int8_head_scopes is not None else scopes
        static_ops = ("Conv", "MatMul", "Gemm")
    if e.int8_keep_float:  # the user's own, checked against the graph before the long part
        import onnx

        from d2export.config import ConfigError

        named = int8.unmatched(onnx.load(str(path), load_external_data=False),
                               static_ops if e.int8 == "static" else int8.DYNAMIC_OPS, e.int8_keep_float)
        if named:
            raise ConfigError(f"export.int8_keep_float: {', '.join(named)} names no convolution or MatMul int8 would "
                              "quantise (names are modules in the nodes' paths, as /backbone/res2/conv1/Conv has "
                              "backbone, res2 and conv1)")
        scopes = tuple(scopes) + tuple(e.int8_keep_float)
    if judged:  # the pictures checked, and the float32 graph scored, before the long part
        from d2export.verification import held_out_accuracy  # detectron2's evaluation, imported when asked for

        held = held_out_accuracy.held_out(subject)
        progress.step(5, "scoring the float32 graph", f"{len(held.records)} labelled pictures of {held.dataset}")
        reference = held_out_accuracy.served_run(subject, held, path, "float32")
    pictures = None
    if e.int8 == "static":
        files = picture_files(e.calibration, e.calibration_count)
        pictures = int8.Pictures(files, _picture_feeds(built, path, subject.exporter))
    how = (f"calibrating on {len(pictures)} pictures ({e.calibration_method}), weights rounded {e.int8_rounding}"
           if pictures else "weights int8, activations quantised per run")
    progress.step(5, f"quantising to int8 ({e.int8}, recipe {e.int8_recipe})", how)
    quantized = path.with_name(f".{path.name}.int8")
    try:
        with progress.busy("quantising"):
            record = int8.quantize(path, quantized, e.int8, scopes, cpu_features(), pictures, e.calibration_method,
                                   static_ops, e.int8_weight_bits, e.int8_rounding)
        if judged:
            progress.step(5, "scoring the int8 graph", f"{len(held.records)} labelled pictures of {held.dataset}")
            accuracy = held_out_accuracy.judge(reference, held_out_accuracy.served_run(subject, held, quantized,
                                                                                       "int8"),
                                               built.cfg.verify.int8_max_drop, held)
        quantized.replace(path)
    finally:
        quantized.unlink(missing_ok=True)
    log.info("int8: %d node(s) quantised, %d kept float (%s); %s", record.quantized, len(record.kept_float),
             ", ".join(scopes) or "none", record.why_reduce_range)
    runtime = serving_runtime(e, "int8")
    made = {"quantization": record.to_dict(), "recipe": e.int8_recipe, "runtime": runtime,
            "keep_float": list(e.int8_keep_float)}
    if not subject.cases:
        return {"passed": None} | made
    if not judged:
        return verify_as_served(subject, "int8") | made
    try:  # recorded: what users receive was judged above
        tensors = verify_as_served(subject, "int8")
    except comparison.VerificationError as refusal:
        tensors = {"passed": False, "refusal": str(refusal).splitlines()[0]}
        log.info("int8 tensors past verify.int8_* (recorded; accuracy judges this graph): %s", tensors["refusal"])
    return {"passed": True, "judged_by": "accuracy", "accuracy": accuracy, "tensors": tensors} | made


def verify_as_served(subject: Subject, precision: str) -> dict:
    """The graph at `precision` verified as the runtime the manifest names serves it (serving_runtime): onnxruntime
    on verify.providers, or OpenVINO (bfloat16; int8 with export.runtime=openvino), its version recorded."""
    if serving_runtime(subject.built.cfg.export, precision) != "openvino":
        return _verify_reduced(subject, precision)
    session, copy = check_sessions.openvino_sessions(subject.path, precision)
    return _verify_reduced(subject, precision, session, copy) | {"openvino": session.version}


def _picture_feeds(built, path: Path, exporter: str):
    """A picture (HWC RGB uint8) → the graph's inputs, as the runtime predictor makes them."""
    from d2export.runtime.processing import Processing

    processing = Processing(served_manifest(built, path, exporter))
    return lambda picture: processing.feeds([processing.prepare(picture, "RGB")])


def _verify_reduced(subject: Subject, precision: str, session=None, copy=None) -> dict:
    """The reduced-precision graph's verification summary against eager float32: each output by its kind, the top-K
    detections the same, near-tied selections pinned where float noise explains them; or VerificationError.
    `session` and `copy` (its selecting copy): the graph as another runtime serves it (bfloat16.py: OpenVINO's);
    by default onnxruntime's on `verify.providers`."""
    cfg, path, cases, names = subject.built.cfg, subject.path, subject.cases, subject.output_names
    tol, kinds = reduced_tolerances(cfg, precision), subject.built.family.output_kinds
    session = session or check_sessions.session(path, cfg.verify.providers, precision)
    copy = copy or check_sessions.selecting_copy(path)  # opened only if a case fails
    summary = comparison.run_reduced_precision(session, names, cases, tol, kinds)
    if not summary["passed"]:
        results = [comparison.Comparison(**c) for c in summary["cases"]]
        agreements = dict(summary["case_agreement"])
        weak = {c for c, a in agreements.items() if a < tol.min_agreement}

        def judge(case, expected, actual):
            compared, agreements[case] = comparison.compare_reduced_case(case, expected, actual, tol, kinds)
            return compared, all(c.ok for c in compared) and agreements[case] >= tol.min_agreement

        failed = weak | {r.case for r in results if not r.ok}
        pinned = _pin_selections(subject, copy, failed, judge,
                                 pinning.Tolerances(tol.atol, tol.rtol, tol.atol, tol.max_mismatch))
        if pinned:
            summary = comparison.reduced_summary(pinning.with_pinned(results, pinned), agreements, tol)
            summary["pinned"] = [p.to_dict() for p in pinned]
    summary |= check_sessions.ran_on(session, path)
    at_cut = sum(c.get("at_cut", 0) for c in summary["cases"] if c["output"] == "scores")
    log.info("%s verification (top-%d agreement %.2f; %d detection(s) came and went at the lists' cut):\n%s",
             tol.precision, tol.top_k, summary["top_k_agreement"], at_cut,
             comparison.format_table([comparison.Comparison(**c) for c in summary["cases"]]))
    if not summary["passed"]:
        failed = [comparison.Comparison(**c) for c in summary["cases"] if not c["ok"]]
        why = [f"{len(failed)} output(s) past their kind's tolerance ({_reduced_settings(cfg, precision)}; ids "
               f"equal) in a detection scoring {tol.confident} or more (verify.confident), or on more than "
               f"{tol.max_mismatch:g} of the rest"] if failed else []
        if summary["top_k_agreement"] < tol.min_agreement:
            why.append(f"top-{tol.top_k} agreement {summary['top_k_agreement']:.2f} < verify.min_top_k_agreement="
                       f"{tol.min_agreement}")
        raise comparison.VerificationError(
            f"the {tol.precision} graph disagrees with eager PyTorch: {'; '.join(why)}\n"
            f"{comparison.format_table(failed)}{pinning.unpinned_lines(summary)}"
            f"{check_sessions.near_ties_lines(copy, cases, failed, tol.precision)}")
    return summary
