"""Verification through near-tied selections: the graph's own picks imposed on eager PyTorch.

A TopK over thousands of near-equal proposal scores may pick or order candidates differently in onnxruntime and in
PyTorch although both compute the same function (float noise differs by CPU and library). Then whole detections
differ and a right graph would be refused depending on the machine. For a case that failed, we read every TopK's
selection out of a verification copy of the graph (extra outputs; the written model is never touched), run eager
again with `torch.topk`/`Tensor.topk` answering, at the matching call, with eager's own values at the graph's
indices, and compare every output again with the normal tolerances. The case passes this way only if every
candidate picked differently lies within float noise of eager's pick at the same position (measured on eager's own
values) and every output then agrees. Anything else fails as it did.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence
from unittest import mock

import numpy as np

from d2export.exporting import near_ties


@dataclass
class Pick:
    """One TopK whose selection differed on a case."""

    node: str
    positions: int  # selected slots (over the batch rows) holding another candidate than eager's
    gap: float  # largest difference, in eager's values, between the graph's pick and eager's at such a slot
    bound: float  # the near-tie bound that gap had to stay within
    why: str = ""  # set where the pick cannot be imposed: not a near-tie, or not a valid selection

    @property
    def tied(self) -> bool:
        return not self.why and self.gap <= self.bound


@dataclass
class PinnedCase:
    case: str
    picks: list[Pick] = field(default_factory=list)
    comparisons: list = field(default_factory=list)  # verify.Comparison after pinning
    why: str = ""  # why pinning could not clear the case ('' when it did)

    @property
    def ok(self) -> bool:
        return not self.why

    def line(self) -> str:
        tied = [p for p in self.picks if p.tied]
        where = "; ".join(f"{p.positions} near-tied position{'s' if p.positions != 1 else ''} at {p.node} "
                          f"(largest gap {p.gap:.2g}, bound {p.bound:.2g})" for p in tied) or "no selection differed"
        if not self.ok:
            return f"{self.case}: pinning did not clear the case: {self.why}"
        worst = max(self.comparisons, key=lambda c: c.max_abs, default=None)
        figure = f" (largest difference: {worst.output} {worst.max_abs:.2g})" if worst is not None else ""
        return f"{self.case}: {where} picked differently; with the graph's selection every output agrees{figure}"

    def to_dict(self) -> dict:
        worst = {}
        for c in self.comparisons:
            worst[c.output] = max(worst.get(c.output, 0.0), c.max_abs)
        return {"case": self.case, "ok": self.ok, "why": self.why, "selections": [asdict(p) for p in self.picks],
                "max_abs_after_pinning": worst}


@dataclass
class _GraphPick:
    node: str
    shape: tuple  # the selected tensor's shape on this case
    k: int
    axis: int  # non-negative
    largest: bool
    indices: np.ndarray


def graph_picks(session, nodes, names: Sequence[str], case_inputs: dict) -> tuple[dict, list[_GraphPick]]:
    """Run the verification copy (`near_ties.selecting_session`) on one case: the model's outputs by name, and each
    TopK's selection in graph order."""
    values = dict(zip(names, session.run(None, case_inputs)))
    picks = []
    for node in nodes:
        x, idx = values[node.input[0]], values[node.output[1]]
        axis = near_ties.attribute(node, "axis", -1) % x.ndim
        picks.append(_GraphPick(node.name or node.output[0], tuple(x.shape), int(idx.shape[axis]), axis,
                                bool(near_ties.attribute(node, "largest", 1)), np.asarray(idx)))
    return values, picks


class _Pinner:
    """Stands in for torch.topk during one eager run: each call is matched, in order, to the next graph TopK of the
    same signature (selected shape, k, axis, largest) and answered with eager's values at the graph's indices where
    the two selections differ only within `close` (relative) of eager's values."""

    def __init__(self, picks: list[_GraphPick], close: float, topk: Callable):
        self.picks, self.close, self.topk = picks, close, topk
        self.next = 0
        self.matched = 0
        self.found: list[Pick] = []

    def __call__(self, input, k, dim=-1, largest=True, sorted=True, **kw):  # noqa: A002 - torch.topk's own names
        values, indices = self.topk(input, k, dim=dim, largest=largest, sorted=sorted, **kw)
        axis = (dim if dim is not None else -1) % max(input.dim(), 1)
        signature = (tuple(input.shape), int(k), axis, bool(largest))
        for j in range(self.next, len(self.picks)):
            g = self.picks[j]
            if (g.shape, g.k, g.axis, g.largest) == signature:
                self.next = j + 1
                self.matched += 1
                return self._impose(g, input, values, indices)
        return values, indices

    def _impose(self, g: _GraphPick, x, values, indices):
        import torch

        mine = indices.detach().cpu().numpy()
        if np.array_equal(mine, g.indices):
            return values, indices
        axis = g.axis
        rows = np.moveaxis(x.detach().cpu().double().numpy(), axis, -1)
        e, p = np.moveaxis(mine, axis, -1), np.moveaxis(g.indices, axis, -1)
        n = rows.shape[-1]
        if p.min() < 0 or p.max() >= n:
            return self._refuse(g, values, indices, "the graph's indices lie outside the candidates")
        ordered = np.sort(p, axis=-1)
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            return self._refuse(g, values, indices, "the graph picked a candidate twice")
        ve, vp = np.take_along_axis(rows, e, -1), np.take_along_axis(rows, p, -1)
        differs = e != p
        gap = float(np.abs(vp - ve)[differs].max())
        bound = near_ties.threshold(self.close, float(np.abs(ve).mean()))
        self.found.append(Pick(g.node, int(differs.sum()), gap, bound))
        if gap > bound:
            return values, indices  # a real difference: eager keeps its own pick and the case fails as before
        pinned = torch.as_tensor(g.indices, dtype=indices.dtype, device=indices.device)
        return torch.take_along_dim(x, pinned, dim=axis), pinned

    def _refuse(self, g, values, indices, why: str):
        self.found.append(Pick(g.node, 0, float("inf"), 0.0, why))
        return values, indices


@contextlib.contextmanager
def pinned_topk(picks: list[_GraphPick], close: float) -> Iterator[_Pinner]:
    """Scoped: torch.topk and Tensor.topk impose the graph's picks (see `_Pinner`); restored on exit."""
    import torch

    pinner = _Pinner(picks, close, torch.topk)
    method = lambda self, *a, **kw: pinner(self, *a, **kw)  # noqa: E731
    with mock.patch.object(torch, "topk", pinner), mock.patch.object(torch.Tensor, "topk", method):
        yield pinner


def pin_case(case, session, nodes, names: Sequence[str], output_names: Sequence[str],
             rerun: Callable[[object], list], judge: Callable[[str, dict, dict], tuple[list, bool]],
             precision: str = "float32") -> PinnedCase:
    """One failed case again, with the graph's selections imposed on eager where they differ only by float noise.
    `rerun(case)`: eager outputs in output order; `judge(case, expected, actual)`: (comparisons, ok) with the
    normal tolerances."""
    values, picks = graph_picks(session, nodes, names, case.inputs)
    with pinned_topk(picks, near_ties.CLOSE[precision]) as pinner:
        expected = dict(zip(output_names, rerun(case)))
    result = PinnedCase(case.name, pinner.found)
    refused = [p for p in pinner.found if not p.tied]
    if not pinner.matched:
        result.why = ("no torch.topk call of eager's matches a TopK of the graph (selected shape, k, axis): the graph "
                      "does not select what eager selects")
    elif not pinner.found:
        result.why = "every selection the graph made is eager's own: the difference is not a tie"
    elif refused:
        result.why = "; ".join(f"{p.node}: {p.why or _far(p)}" for p in refused)
    if result.why:
        return result
    result.comparisons, ok = judge(case.name, expected, {n: values[n] for n in output_names})
    if not ok:
        bad = sorted({c.output for c in result.comparisons if not c.ok})
        result.why = f"with the graph's selection imposed, {', '.join(bad)} still disagree"
    return result


def _far(p: Pick) -> str:
    return f"a candidate picked {p.gap:.2g} away (in eager's values) from eager's pick, past the near-tie bound {p.bound:.2g}"


def pin_cases(path, cases, output_names: Sequence[str], rerun, judge, session_options=None,
              precision: str = "float32") -> list[PinnedCase]:
    """`pin_case` for each of `cases` (the failed ones) on the graph at `path`."""
    session, nodes = near_ties.selecting_session(path, session_options)
    if not nodes:
        return [PinnedCase(c.name, why="the graph makes no selection (TopK)") for c in cases]
    names = [o.name for o in session.get_outputs()]
    return [pin_case(c, session, nodes, names, output_names, rerun, judge, precision) for c in cases]
