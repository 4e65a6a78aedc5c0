"""A failed case rerun with the graph's near-tied selections pinned on eager (pinning.py): the step float32 and
reduced-precision verification share, apart so that neither imports the other."""
from __future__ import annotations

import logging

from d2export import progress
from d2export.verification import pinning
from d2export.verification.subject import Subject

log = logging.getLogger("d2export")


def _pin_selections(subject: Subject, copy, failed_names: set, judge, tolerances: pinning.Tolerances) -> list:
    """The failed cases again with the graph's near-tied selections (read off `copy`, check_sessions.selecting_copy) imposed
    on eager (exporting/pinning.py), its candidate values held to `tolerances` (those of the outputs);
    `judge(case, expected, actual)` → (comparisons, whether the case passes), by the precision's own rules."""
    failed = [c for c in subject.cases if c.images is not None and c.name in failed_names]
    if not failed or not subject.built.cfg.verify.pin_selections:
        return []
    reference = subject.built.adapter.reference
    with progress.busy("checking the failed cases' selections"):
        pinned = pinning.pin_cases(copy, failed, subject.output_names, lambda c: reference(c.images), judge,
                                   tolerances)
    for p in pinned:
        log.log(logging.INFO if p.ok else logging.WARNING, "%s", p.line())
    return pinned
