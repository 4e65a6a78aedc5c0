"""A reduced-precision graph (float16; int8 to come) verified against eager float32: each output by its kind
(`verify.Reduced`), the top-K detections the same, near-tied selections pinned where float noise explains them. The
pipeline converts the verified float32 graph and hands it here; nothing is written if it is refused."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Mapping, Sequence

from d2export.exporting import pinning, sessions
from d2export.exporting import verify as verify_mod

log = logging.getLogger("d2export")


def verify(path: Path, output_names: Sequence[str], cases: Sequence[verify_mod.Case], tol: verify_mod.Reduced,
           kinds: Mapping[str, str], providers, pin: Callable, settings: str) -> dict:
    """The verification summary of the graph at `path`, or VerificationError with the figures. `pin(failed case
    names, judge, pinning.Tolerances)` pins the failed cases' selections (the pipeline's, which can rerun eager);
    `settings` names the config keys behind `tol`, for the message."""
    session = sessions.session(path, providers)
    summary = verify_mod.run_reduced_precision(session, output_names, cases, tol, kinds)
    if not summary["passed"]:
        results = [verify_mod.Comparison(**c) for c in summary["cases"]]
        agreements = dict(summary["case_agreement"])
        weak = {c for c, a in agreements.items() if a < tol.min_agreement}

        def judge(case, expected, actual):
            compared, agreements[case] = verify_mod.compare_reduced_case(case, expected, actual, tol, kinds)
            return compared, all(c.ok for c in compared) and agreements[case] >= tol.min_agreement

        failed = weak | {r.case for r in results if not r.ok}
        pinned = pin(failed, judge, pinning.Tolerances(tol.atol, tol.rtol, tol.atol, tol.max_mismatch))
        if pinned:
            summary = verify_mod.reduced_summary(pinning.with_pinned(results, pinned), agreements, tol)
            summary["pinned"] = [p.to_dict() for p in pinned]
    summary |= sessions.ran_on(session, path)
    at_cut = sum(c.get("at_cut", 0) for c in summary["cases"] if c["output"] == "scores")
    log.info("%s verification (top-%d agreement %.2f; %d detection(s) came and went at the lists' cut):\n%s",
             tol.precision, tol.top_k, summary["top_k_agreement"], at_cut,
             verify_mod.format_table([verify_mod.Comparison(**c) for c in summary["cases"]]))
    if not summary["passed"]:
        failed = [verify_mod.Comparison(**c) for c in summary["cases"] if not c["ok"]]
        why = [f"{len(failed)} output(s) past their kind's tolerance ({settings}; ids equal) in a detection scoring "
               f"{tol.confident} or more (verify.confident), or on more than {tol.max_mismatch:g} of the rest"
               ] if failed else []
        if summary["top_k_agreement"] < tol.min_agreement:
            why.append(f"top-{tol.top_k} agreement {summary['top_k_agreement']:.2f} < verify.min_top_k_agreement="
                       f"{tol.min_agreement}")
        raise verify_mod.VerificationError(
            f"the {tol.precision} graph disagrees with eager PyTorch: {'; '.join(why)}\n"
            f"{verify_mod.format_table(failed)}{pinning.unpinned_lines(summary)}"
            f"{sessions.near_ties_lines(path, cases, failed, tol.precision)}")
    return summary
