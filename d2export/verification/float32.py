"""The float32 graph verified against eager PyTorch: each output within its kind's tolerance at the verification sizes,
failed cases rerun with the graph's selections pinned and the parity ladder's first diverging module named in a
refusal; and the graph against eager below torch.export's minimums (whether smaller pictures are served as they are)."""
from __future__ import annotations

import logging
from typing import Sequence

from d2export import progress
from d2export.verification import check_sessions, comparison, ladder, pinning
from d2export.verification.failed_cases import _pin_selections
from d2export.verification.ladder import ROOT
from d2export.verification.size_refusals import SIZE_ERRORS, _innermost, model_size_error
from d2export.verification.subject import Subject
from d2export.verification.tolerances import float32_tolerances
from d2export.tracing import dummy_images, graph_inputs

log = logging.getLogger("d2export")


def verify_float32(subject: Subject) -> dict:
    """The float32 graph's verification summary (the manifest's), or VerificationError with the figures, the
    parity ladder's first diverging module and the near-tied selections of the failed cases."""
    built, tol = subject.built, float32_tolerances(subject.built.cfg)
    progress.step(5, "verifying with onnxruntime", f"{len(subject.cases)} cases")
    session = check_sessions.session(subject.path, built.cfg.verify.providers)
    copy = check_sessions.selecting_copy(subject.path)  # opened only if a case fails
    results, pinned = _float32_results(subject, session, copy)
    log.info("verification:\n%s", comparison.format_table(results))
    summary = comparison.summarise(results) | {
        "atol": tol.atol, "rtol": tol.rtol, "pixel_atol": tol.pixel_atol,
        "tolerances": {kind: {"atol": a, "rtol": r} for kind, (a, r) in tol.by_kind().items()},
        "output_kinds": {n: comparison.output_kind(n, built.family.output_kinds) for n in subject.output_names}
    } | check_sessions.ran_on(session, subject.path)
    if pinned:
        summary["pinned"] = [p.to_dict() for p in pinned]
    if built.cfg.verify.ladder or not summary["passed"]:
        summary["ladder"] = ladder._ladder_summary(subject)
    try:
        comparison.check(results)
    except comparison.VerificationError as e:
        ties = check_sessions.near_ties_lines(copy, subject.cases, results, "float32")
        raise comparison.VerificationError(f"{e}{_culprit_line(summary['ladder'])}{pinning.unpinned_lines(summary)}"
                                       f"{ties}") from None
    return summary


def _float32_results(subject: Subject, session, copy) -> tuple[list, list]:
    """Every case's comparisons within the float32 tolerances, failed cases rerun with the graph's near-tied
    selections pinned; and those pinnings."""
    built, tol = subject.built, float32_tolerances(subject.built.cfg)
    kinds, sorted_by = built.family.output_kinds, built.family.sorted_by
    per_output = tol.per_output(subject.output_names, kinds)
    results = comparison.run_cases(session, subject.output_names, subject.cases, tol.atol, tol.rtol, tol.max_mismatch,
                               sorted_by, per_output)

    def judge(case, expected, actual):
        compared = comparison.compare_case(case, expected, actual, tol.atol, tol.rtol, tol.max_mismatch, sorted_by,
                                       per_output)
        return compared, all(c.ok for c in compared)

    pinned = _pin_selections(subject, copy, {r.case for r in results if not r.ok}, judge,
                             pinning.Tolerances(tol.atol, tol.rtol, tol.pixel_atol))
    return pinning.with_pinned(results, pinned), pinned


# ---------------------------------------------------------------------------------------- below torch.export's minimum
def sizes_below(min_sizes: dict[str, int], dummy: Sequence[int], smallest: int = 8) -> list[tuple[int, int]]:
    """(height, width) sizes under the lint's minimums, largest first: an axis with a minimum at one below it, then
    halved down to `smallest`; an axis without one at the dummy's size."""
    def axis(name: str) -> list[int]:
        sizes, v = [], min_sizes.get(name, 0) - 1
        while v >= smallest:
            sizes.append(v)
            v //= 2
        return sizes

    heights, widths = axis("height"), axis("width")
    n = max(len(heights), len(widths))
    pad = lambda values, default: values + [values[-1] if values else default] * (n - len(values))  # noqa: E731
    return list(zip(pad(heights, int(dummy[0])), pad(widths, int(dummy[1]))))


def check_below_minimums(subject: Subject, min_sizes: dict[str, int]) -> dict:
    """torch.export's minimums are what its capture assumed, not always what the graph needs: size-oblivious tracing
    asserts that no feature level is a single pixel, which an ONNX graph's broadcasting does not care about, while a
    branch on a size really is the dummy's. The graph against eager at sizes below them (`sizes_below`, one synthetic
    picture each, the float32 tolerances): `held` where it agrees at every one (the runtime then takes any size),
    else the first size where it does not (`failed`: the runtime pads smaller pictures up to the minimums).

    A size where the eager model refuses to run ends the walk (`eager_fails`) only when the refusal is the model's own
    size error (`model_size_error`): one of SIZE_ERRORS (not a NotImplementedError) whose innermost frame is outside
    d2export and outside torch's tracers. Any other exception (a TypeError, anything raised in d2export's own code)
    fails the export with its message: it is no limit of the model's, and taking it as one would leave smaller
    pictures served unverified."""
    built = subject.built
    cases, eager_fails = [], None
    for i, (h, w) in enumerate(sizes_below(min_sizes, built.cfg.export.dummy_sizes[0])):
        images = dummy_images([(h, w)], seed=2000 + 10 * i)
        try:
            expected = built.adapter.reference(images)
        except Exception as e:  # noqa: BLE001 — sorted just below: the model's own limit, or a failure
            line = f"{h}x{w}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if not model_size_error(e):
                raise RuntimeError(f"below torch.export's minimums {min_sizes}, the eager reference failed at {line} "
                                   f"({_innermost(e)}): not one of the model's own size errors "
                                   f"({', '.join(k.__name__ for k in SIZE_ERRORS)} raised in its code)") from e
            eager_fails = line
            break
        cases.append(comparison.Case(f"{h}x{w}", graph_inputs(built.adapter, images), expected, images))
    failed = None
    if cases:
        below = Subject(built, subject.path, cases, subject.route)
        results, _ = _float32_results(below, check_sessions.session(subject.path, built.cfg.verify.providers),
                                      check_sessions.selecting_copy(subject.path))
        failed = next((c.name for c in cases if not all(r.ok for r in results if r.case == c.name)), None)
        verdict = ("the graph agrees: served at any size" if failed is None else
                   f"the graph differs at {failed}: the runtime pads smaller pictures up to the minimums")
        log.log(logging.INFO if failed is None else logging.WARNING, "below torch.export's minimums %s, %s:\n%s",
                min_sizes, verdict, comparison.format_table(results))
    return {"tried": [c.name for c in cases], "held": bool(cases) and failed is None, "failed": failed,
            "eager_fails": eager_fails}


def _culprit_line(ladder_summary: dict) -> str:
    """Where the parity ladder saw the graph diverge first, or that it crashed, for a refusal ('' where it ran and
    no module diverges)."""
    culprit = ladder_summary["culprit"]
    if ladder_summary.get("error"):
        return f"\nthe parity ladder crashed (no module compared): {ladder_summary['error']}"
    if culprit is None:
        return ""
    return (f"\nthe parity ladder's first diverging module: {culprit['module'] or ROOT} at {culprit['case']}, "
            f"forward at {culprit['source']}")
