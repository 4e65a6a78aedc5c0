"""Verification: onnxruntime against eager PyTorch, output by output, case by case."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np


class VerificationError(RuntimeError):
    """onnxruntime disagreed with eager PyTorch past the tolerance; the message carries the figures."""


@dataclass
class Case:
    name: str  # e.g. "320x320", "batch2 320x320+256x384"
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray]  # eager outputs, in output order
    images: list | None = None  # the pictures behind `inputs`, for an eager rerun (pinned selections)


@dataclass
class Comparison:
    case: str
    output: str
    shape: list
    max_abs: float
    max_rel: float
    mismatch: float  # fraction of elements outside tolerance
    ok: bool
    at_cut: int = 0  # reduced precision: detections left out of the comparison as come-and-go at the list's cut


@dataclass
class Difference:
    max_abs: float
    max_rel: float
    mismatch: float  # fraction of elements outside atol + rtol·|expected|
    first_bad: list | None  # index of the first such element
    ok: bool


def difference(expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float,
               max_mismatch: float = 0.0) -> Difference:
    """How far `actual` is from `expected`. Equal non-finite values agree; argmax-like integer (and boolean) outputs
    may flip on near-ties, so a fraction `max_mismatch` of them may differ — never of floats."""
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.shape != actual.shape:
        return Difference(float("inf"), float("inf"), 1.0, None, False)
    if expected.size == 0:
        return Difference(0.0, 0.0, 0.0, None, True)
    diff, finite_e, bad = _elementwise(expected, actual, atol, rtol)
    with np.errstate(all="ignore"):
        rel = np.where(np.isfinite(diff), diff / np.maximum(np.abs(finite_e), 1e-6), 0.0)
    mismatch = float(bad.mean())
    allowed = max_mismatch if expected.dtype.kind in "biu" else 0.0
    first = [int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape)] if bad.any() else None
    return Difference(float(diff.max()), float(rel.max()), mismatch, first, mismatch <= allowed)


def _elementwise(expected: np.ndarray, actual: np.ndarray, atol: float,
                 rtol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """|actual - expected| in float64 (0 where equal, NaNs included; inf where one side alone is not finite),
    `expected` with non-finite values as 0 (what tolerances scale with), and where the first lies outside
    atol + rtol·|expected|."""
    e, a = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    with np.errstate(all="ignore"):
        same = (e == a) | (np.isnan(e) & np.isnan(a))
        diff = np.where(same, 0.0, np.nan_to_num(np.abs(a - e), nan=np.inf))
    finite_e = np.where(np.isfinite(e), e, 0.0)
    return diff, finite_e, diff > atol + rtol * np.abs(finite_e)


def compare(case: str, name: str, expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float,
            max_mismatch: float) -> Comparison:
    d = difference(expected, actual, atol, rtol, max_mismatch)
    shape = np.shape(expected) if np.shape(expected) == np.shape(actual) else np.shape(actual)
    return Comparison(case, name, list(shape), d.max_abs, d.max_rel, d.mismatch, d.ok)


KINDS = ("probabilities", "logits", "masks", "pixels", "ids")


def tolerances_by_kind(atol: float, rtol: float, pixel_atol: float) -> dict[str, tuple[float, float]]:
    """(atol, rtol) per kind of output: coordinates in pixels get their own absolute tolerance, ids must match (a
    fraction `max_mismatch` of them may flip on near-ties), everything else gets `atol`."""
    return {"probabilities": (atol, rtol), "logits": (atol, rtol), "masks": (atol, rtol), "pixels": (pixel_atol, rtol),
            "ids": (0.0, 0.0)}


def output_tolerances(names: Sequence[str], kinds: Mapping[str, str],
                      by_kind: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Each output's (atol, rtol) from its kind (`Family.output_kinds`; an output not listed counts as logits)."""
    return {n: by_kind[output_kind(n, kinds)] for n in names}


def output_kind(name: str, kinds: Mapping[str, str]) -> str:
    return kinds.get(name, "logits")


def run_cases(session, output_names: Sequence[str], cases: Sequence[Case], atol: float, rtol: float,
              max_mismatch: float = 1e-3, sorted_by: str | None = None,
              per_output: Mapping[str, tuple[float, float]] | None = None) -> list[Comparison]:
    """Every case through the session, every output compared (`compare_case`)."""
    from d2export.progress import steps

    results = []
    for case in steps(cases, "verifying"):
        actual = dict(zip(output_names, session.run(list(output_names), case.inputs)))
        results += compare_case(case.name, dict(zip(output_names, case.expected)), actual, atol, rtol, max_mismatch,
                                sorted_by, per_output)
    return results


def compare_case(case: str, expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], atol: float,
                 rtol: float, max_mismatch: float = 1e-3, sorted_by: str | None = None,
                 per_output: Mapping[str, tuple[float, float]] | None = None) -> list[Comparison]:
    """Every output of one case, within `per_output[name]` = (atol, rtol) where given, else `atol`, `rtol`.
    `sorted_by`: the graph's outputs are detections sorted by that output (descending), so slots whose values tie
    may come in either order: that output is compared slot by slot as it is, the others after matching each
    expected detection to the actual slot that holds it."""
    order = None
    if sorted_by in actual and actual[sorted_by].shape == expected[sorted_by].shape:
        order = match_slots(expected, actual, sorted_by)
    tolerance = dict(per_output or {})
    return [compare(case, name, e, actual[name] if name == sorted_by else reordered(actual[name], order),
                    *tolerance.get(name, (atol, rtol)), max_mismatch) for name, e in expected.items()]


def reordered(actual: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    """[N, K, …] per-slot output with its slots in the expected order (`order` from `match_slots`; None: as it is)."""
    if order is None or actual.ndim < 2 or actual.shape[:2] != order.shape:
        return actual
    return np.take_along_axis(actual, order.reshape(order.shape + (1,) * (actual.ndim - 2)), axis=1)


def summarise(results: Sequence[Comparison]) -> dict:
    return {
        "passed": all(r.ok for r in results),
        "max_abs": max((r.max_abs for r in results), default=0.0),
        "cases": [asdict(r) for r in results],
    }


def format_table(results: Sequence[Comparison]) -> str:
    rows = [f"{'case':<28} {'output':<16} {'shape':<18} {'max abs':>10} {'max rel':>10} {'mismatch':>9}  ok"]
    for r in results:
        rows.append(f"{r.case:<28} {r.output:<16} {str(list(r.shape)):<18} {r.max_abs:>10.3g} {r.max_rel:>10.3g} "
                    f"{r.mismatch:>9.2%}  {'yes' if r.ok else 'NO'}")
    return "\n".join(rows)


def check(results: Sequence[Comparison]) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        raise VerificationError("onnxruntime disagrees with eager PyTorch:\n" + format_table(failed))


def match_slots(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], score_output: str) -> np.ndarray:
    """For each batch row, the actual detection slot that holds each expected slot's detection ([N, K] indices).
    Outputs are [N, K, …] per detection, sorted by score; reduced precision reorders near-equal scores, so slots are
    matched by content (greedily, nearest first over every output of that layout: a float output by its mean distance
    relative to its mean magnitude, an id output by the fraction of its ids that differ, so that a detection's
    counterpart is one of its own class even where another class's detection of the same object scores alike)
    rather than by position."""
    n, k = expected[score_output].shape[:2]
    per_slot = _per_slot(expected, actual, n, k)
    order = np.zeros((n, k), dtype=np.int64)
    for row in range(n):
        cost = np.zeros((k, k))
        for name in per_slot:
            e = expected[name][row].reshape(k, -1)
            a = actual[name][row].reshape(k, -1)
            if e.dtype.kind != "f":
                cost += (e[:, None, :] != a[None, :, :]).mean(-1)
                continue
            e, a = e.astype(np.float64), a.astype(np.float64)
            scale = np.abs(e).mean() + 1e-6
            cost += np.abs(e[:, None, :] - a[None, :, :]).mean(-1) / scale
        taken_e, taken_a = set(), set()
        for flat in np.argsort(cost, axis=None, kind="stable"):
            i, j = divmod(int(flat), k)
            if i not in taken_e and j not in taken_a:
                order[row, i] = j
                taken_e.add(i)
                taken_a.add(j)
    return order


def _per_slot(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], n: int, k: int) -> list[str]:
    """The outputs laid out [N, K, …], one entry per detection slot."""
    return [name for name, e in expected.items()
            if e.dtype.kind in "fbiu" and e.ndim >= 2 and e.shape[:2] == (n, k) and actual[name].shape == e.shape]


def at_the_cut(expected: dict[str, np.ndarray], paired: dict[str, np.ndarray], score_output: str,
               tolerance: Mapping[str, tuple[float, float]]) -> np.ndarray:
    """[N, K] bool: expected slots whose matched pair (`paired`: the graph's outputs in the expected order, as
    `reordered` gives them) disagrees but may have come and gone where the list is cut.
    A list keeps the K best-scoring detections; one scoring within the score tolerance of the other list's lowest
    kept score may fall out of that list under noise the tolerance allows, and another takes its slot. Such a pair
    is excused only if both of its scores lie within the tolerance of the other list's cut: a detection that scores
    clearly above the cut must still be found, with its outputs within tolerance (`tolerance[name]`: (atol, rtol);
    ids agree only where equal)."""
    n, k = expected[score_output].shape[:2]
    per_slot = _per_slot(expected, paired, n, k)
    if score_output not in per_slot:  # the scores' layouts differ: nothing is excused
        return np.zeros((n, k), dtype=bool)
    agrees = np.ones((n, k), dtype=bool)
    for name in per_slot:
        e, a = expected[name], paired[name]
        near = ~_elementwise(e, a, *tolerance[name])[2] if e.dtype.kind == "f" else e == a
        agrees &= near.reshape(n, k, -1).all(-1)
    atol, rtol = tolerance[score_output]
    e_s, a_s = expected[score_output].astype(np.float64), paired[score_output].astype(np.float64)
    reach = lambda cut: cut + atol + rtol * np.abs(cut)  # noqa: E731 - the highest score noise can carry to the cut
    e_cut, a_cut = e_s.min(axis=1, keepdims=True), a_s.min(axis=1, keepdims=True)
    return ~agrees & (e_s <= reach(a_cut)) & (a_s <= reach(e_cut))


def top_k_agreement(expected: np.ndarray, actual: np.ndarray, k: int, order: np.ndarray | None = None) -> float:
    """The least fraction, over a batch's rows, of the expected top-`k` detections (by score, last axis) that are also
    in the actual top-`k`; `order` (from `match_slots`) says which actual slot holds each expected detection."""
    e, a = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    e, a = e.reshape(-1, e.shape[-1]), a.reshape(-1, a.shape[-1])
    order = np.tile(np.arange(e.shape[-1]), (len(e), 1)) if order is None else order.reshape(len(e), -1)
    k = min(k, e.shape[-1])
    if k == 0:
        return 1.0
    top = lambda x: np.argsort(-x, kind="stable")[:k]  # noqa: E731
    return float(min(len({int(o[i]) for i in top(r)} & set(top(q).tolist())) / k for r, q, o in zip(e, a, order)))


@dataclass(frozen=True)
class Float32:
    """What a float32 graph is held to against eager: each output within its kind's (atol, rtol)
    (`tolerances_by_kind`), and a fraction `max_mismatch` of its ids may flip on near-ties."""
    atol: float
    rtol: float
    pixel_atol: float
    max_mismatch: float

    def by_kind(self) -> dict[str, tuple[float, float]]:
        return tolerances_by_kind(self.atol, self.rtol, self.pixel_atol)

    def per_output(self, names: Sequence[str], kinds: Mapping[str, str]) -> dict[str, tuple[float, float]]:
        return output_tolerances(names, kinds, self.by_kind())


@dataclass(frozen=True)
class Reduced:
    """What a reduced-precision graph (float16, int8) is held to against eager float32, by kind of output: scores,
    probabilities, logits and masks within `atol + rtol·|x|`, coordinates within `pixel_atol + pixel_rtol·|x|` pixels,
    ids equal. A confident detection (scoring at least `confident` on either side) must agree on every output but its
    mask, where an id may flip only if its probability leaves room for a tie; the other detections, masks and outputs
    not laid out per detection may have a fraction `max_mismatch` of their elements outside. The `top_k`
    best-scoring detections must be the same ones for at least `min_agreement` of them."""
    precision: str  # "float16", "int8": what the messages and the manifest call it
    atol: float
    rtol: float
    pixel_atol: float
    pixel_rtol: float
    max_mismatch: float
    confident: float = 0.3
    top_k: int = 5
    min_agreement: float = 0.8

    def tolerance(self, kind: str) -> tuple[float, float]:
        return {"ids": (0.0, 0.0), "pixels": (self.pixel_atol, self.pixel_rtol)}.get(kind, (self.atol, self.rtol))


# The probability beside an id output: under softmax a class over one half (plus the tolerance) has no rival within
# the tolerance, so only an id whose probability is at most that may flip in a confident detection.
TIE_SCORES = {"labels": "scores", "char_ids": "char_scores"}


def run_reduced_precision(session, output_names: Sequence[str], cases: Sequence[Case], tol: Reduced,
                          kinds: Mapping[str, str], score_output: str = "scores") -> dict:
    """A reduced-precision graph against eager float32, case by case (`compare_reduced_case`)."""
    from d2export.progress import steps

    results, agreements = [], {}
    for case in steps(cases, f"verifying {tol.precision}"):
        actual = dict(zip(output_names, session.run(list(output_names), case.inputs)))
        compared, agreements[case.name] = compare_reduced_case(case.name, dict(zip(output_names, case.expected)),
                                                               actual, tol, kinds, score_output)
        results += compared
    return reduced_summary(results, agreements, tol)


def compare_reduced_case(case: str, expected: dict[str, np.ndarray], actual: dict[str, np.ndarray], tol: Reduced,
                         kinds: Mapping[str, str], score_output: str = "scores") -> tuple[list, float]:
    """Detections are matched by content first (`match_slots`); pairs that came and went at the list's cut
    (`at_the_cut`) are left out; the rest are judged as `Reduced` says, each output by its kind (`kinds`: name →
    kind, as `Family.output_kinds`). The pairs left out count neither way, so a list mostly at its cut cannot hide the
    detections above it. Returns the comparisons and the fraction of the top-`tol.top_k` detections by
    `score_output` that are the same ones (1.0 without scores)."""
    tolerance = {name: tol.tolerance(output_kind(name, kinds)) for name in expected}
    order = match_slots(expected, actual, score_output) if score_output in actual else None
    paired = {name: reordered(actual[name], order) for name in expected}
    cut = None if order is None else at_the_cut(expected, paired, score_output, tolerance)
    confident = None
    if cut is not None and paired[score_output].shape == expected[score_output].shape:
        confident = np.maximum(expected[score_output], paired[score_output]) >= tol.confident
    results = []
    for name, e in expected.items():
        a, excused, strict = paired[name], 0, None
        if np.shape(a) != np.shape(e):
            results.append(Comparison(case, name, list(np.shape(e)), float("inf"), float("inf"), 1.0, False))
            continue
        if cut is not None and e.ndim >= 2 and e.shape[:2] == cut.shape:
            strict = confident[~cut] if confident is not None else np.zeros(int((~cut).sum()), bool)
            e, a, excused = e[~cut], a[~cut], int(cut.sum())  # [pairs kept, ...]
        d = difference(e, a, *tolerance[name])
        ok = d.mismatch <= tol.max_mismatch
        if strict is not None and strict.any() and output_kind(name, kinds) != "masks":  # a mask's edge may waver
            wrong = _elementwise(e[strict], a[strict], *tolerance[name])[2]
            tie = TIE_SCORES.get(name)
            if wrong.any() and tie in expected and np.shape(expected[tie]) == np.shape(expected[name]):
                wrong = wrong & (expected[tie][~cut][strict] > 0.5 + tol.atol)  # a flip where no tie is possible
            ok = ok and not wrong.any()
        results.append(Comparison(case, name, list(np.shape(expected[name])), d.max_abs, d.max_rel, d.mismatch, ok,
                                  excused))
    agreement = 1.0 if order is None else top_k_agreement(expected[score_output], actual[score_output], tol.top_k,
                                                           order)
    return results, agreement


def reduced_summary(results: Sequence[Comparison], agreements: dict[str, float], tol: Reduced) -> dict:
    """`agreements`: each case's top-K agreement, by case name."""
    agreement = min(agreements.values(), default=1.0)
    return summarise(results) | {"tolerances": {kind: dict(zip(("atol", "rtol"), tol.tolerance(kind)))
                                                for kind in KINDS},
                                 "max_mismatch": tol.max_mismatch, "confident": tol.confident, "top_k": tol.top_k,
                                 "top_k_agreement": agreement, "case_agreement": agreements,
                                 "min_top_k_agreement": tol.min_agreement,
                                 "passed": all(r.ok for r in results) and agreement >= tol.min_agreement}
