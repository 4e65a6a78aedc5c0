"""Verification through near-tied selections: the graph's own picks imposed on eager PyTorch.

A TopK over thousands of near-equal proposal scores, an NMS among overlapping boxes of near-equal scores, or a hard
threshold inside the network (Mask2Former's attention masks: a mask probability `< 0.5`) may pick, order or flip
candidates differently in onnxruntime and in PyTorch although both compute the same function (float noise
differs by CPU, library and precision). Then whole detections differ and a right graph would be refused depending on
the machine. For a case that failed, we read every TopK's and NMS's candidates and selection and every threshold's values and
result out of a verification copy of the graph (extra outputs; the written model is never touched), run eager again
with `torch.topk`, `Tensor.topk`, torchvision's `batched_nms` and the comparison operators answering, at the matching
call, with the graph's selection, and
compare every output again with the normal tolerances. A selection is imposed only where the graph's candidate
values stand from eager's within the tolerances its outputs are held to, and the graph's pick is what eager's values
give once each may move by that measured difference: float noise explains it. Anything else fails as it did.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence
from unittest import mock

import numpy as np

from d2export.verification import near_ties


@dataclass(frozen=True)
class Tolerances:
    """How far the graph's candidate values may stand from eager's: as its outputs may (|d| <= atol + rtol·|eager|,
    coordinates with `pixel_atol`, on all but a fraction `max_mismatch` of the elements)."""

    atol: float
    rtol: float
    pixel_atol: float
    max_mismatch: float = 0.0

    def past(self, eager: np.ndarray, graph: np.ndarray, pixels: bool = False) -> np.ndarray:
        """Where |graph - eager| lies past the tolerance."""
        return _difference(eager, graph) > (self.pixel_atol if pixels else self.atol) + self.rtol * np.abs(eager)

    def within(self, eager: np.ndarray, graph: np.ndarray, pixels: bool = False) -> tuple[float, bool]:
        """(the largest |graph - eager|, whether the elements past their tolerance are few enough)."""
        d = _difference(eager, graph)
        if not d.size:
            return 0.0, True
        return float(d.max()), float(self.past(eager, graph, pixels).mean()) <= self.max_mismatch


def _difference(a, b) -> np.ndarray:
    """|a - b| in float64, 0 where they are equal (equal infinities: masked candidates), inf where either is NaN."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(a == b, 0.0, np.abs(a - b))
    return np.where(np.isnan(d), np.inf, d)


@dataclass
class Pick:
    """One selection (TopK or NMS) that differed on a case."""

    node: str
    positions: int  # selected slots (over the batch rows) holding another candidate than eager's
    gap: float  # the largest difference, in eager's values, that the graph's pick needed (see `_Pinner`)
    bound: float  # what float noise explains: twice the graph's largest difference from eager at the candidates
    why: str = ""  # set where the pick cannot be imposed: not float noise, or not a valid selection

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
    values: np.ndarray  # the graph's candidates on this case
    k: int
    axis: int  # non-negative
    largest: bool
    indices: np.ndarray  # an ArgMax's with its axis kept
    op: str = "TopK"  # or "ArgMax": a TopK of one that torch.argmax computes

    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)


@dataclass
class _GraphSuppression:
    node: str
    boxes: np.ndarray  # (N, 4) the boxes the graph's NMS saw on this case (class-offset, as traced)
    scores: np.ndarray  # (N,)
    keep: np.ndarray  # the kept candidates' indices, in the graph's order


@dataclass
class _GraphThreshold:
    node: str
    values: np.ndarray  # what the graph compared on this case
    op: str  # "lt", "le", "gt", "ge"
    threshold: float
    result: np.ndarray  # bool

    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)


_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal}


def graph_picks(session, nodes, names: Sequence[str], case_inputs: dict) -> tuple[dict, list]:
    """Run the verification copy (`near_ties.selecting_session`) on one case: the model's outputs by name, and each
    TopK's and NMS's candidates and selection and each threshold's values and result, in graph order."""
    values = dict(zip(names, session.run(None, case_inputs)))
    picks = []
    for node in nodes:
        if isinstance(node, near_ties.Threshold):
            picks.append(_GraphThreshold(node.name, np.asarray(values[node.input[0]]), node.op, node.threshold,
                                         np.asarray(values[node.output[0]], bool)))
            continue
        if node.op_type == "NonMaxSuppression":
            boxes, scores, selected = (values[n] for n in (*node.input, *node.output))
            picks.append(_GraphSuppression(node.name, np.asarray(boxes).reshape(-1, 4), np.asarray(scores).reshape(-1),
                                           np.asarray(selected)[:, 2]))
            continue
        if node.op_type == "ArgMax":  # the first of the largest, as torch.argmax
            x, idx = np.asarray(values[node.input[0]]), np.asarray(values[node.output[0]])
            axis = near_ties.attribute(node, "axis", 0) % x.ndim
            idx = idx if near_ties.attribute(node, "keepdims", 1) else np.expand_dims(idx, axis)
            picks.append(_GraphPick(node.name or node.output[0], x, 1, axis, True, idx, "ArgMax"))
            continue
        x, idx = values[node.input[0]], values[node.output[1]]
        axis = near_ties.attribute(node, "axis", -1) % x.ndim
        picks.append(_GraphPick(node.name or node.output[0], np.asarray(x), int(idx.shape[axis]), axis,
                                bool(near_ties.attribute(node, "largest", 1)), np.asarray(idx)))
    return values, picks


class _Pinner:
    """Stands in for torch.topk and torchvision's batched NMS during one eager run.

    Each TopK call is matched, in order, to the next graph TopK of the same signature (selected shape, k, axis,
    largest); each batched NMS, computed as the graph computes it (one NMS over class-offset boxes), to the next graph
    NMS over as many boxes. Where the selections differ, the graph's is imposed (eager's values at the graph's
    indices; the graph's kept boxes) if its candidate values stand within `tolerances` of eager's and its pick is
    what eager's values give once each may move by the largest such difference. Otherwise eager keeps its own pick
    and the case fails as it did."""

    def __init__(self, picks: list, tolerances: Tolerances, topk: Callable, suppress: Callable,
                 compare: dict[str, Callable] | None = None, argmax: Callable | None = None):
        self.picks = [p for p in picks if isinstance(p, _GraphPick)]
        self.argmax_fn, self.next_argmax = argmax, 0
        self.suppressions = [p for p in picks if isinstance(p, _GraphSuppression)]
        self.thresholds = [p for p in picks if isinstance(p, _GraphThreshold)]
        self.tolerances, self.topk, self.suppress, self.compare = tolerances, topk, suppress, compare or {}
        self.next = self.next_suppression = self.next_threshold = 0
        self.matched = self.matched_thresholds = 0  # eager's calls matched to the graph's TopK/NMS, thresholds
        self.found: list[Pick] = []

    def __call__(self, input, k, dim=-1, largest=True, sorted=True, **kw):  # noqa: A002 - torch.topk's own names
        values, indices = self.topk(input, k, dim=dim, largest=largest, sorted=sorted, **kw)
        axis = (dim if dim is not None else -1) % max(input.dim(), 1)
        signature = (tuple(input.shape), int(k), axis, bool(largest), "TopK")
        for j in range(self.next, len(self.picks)):
            g = self.picks[j]
            if (g.shape, g.k, g.axis, g.largest, g.op) == signature:
                self.next = j + 1
                self.matched += 1
                return self._impose(g, input, values, indices)
        return values, indices

    def argmax(self, input, dim=None, keepdim=False):  # noqa: A002 - torch.argmax's own names
        """torch.argmax along `dim`: matched, in order, to the next graph ArgMax of the input's shape and axis, and
        imposed as a TopK of one is."""
        indices = self.argmax_fn(input, dim=dim, keepdim=keepdim)
        if dim is None:
            return indices
        axis = dim % max(input.dim(), 1)
        kept = indices if keepdim else indices.unsqueeze(axis)
        for j in range(self.next_argmax, len(self.picks)):
            g = self.picks[j]
            if (g.shape, g.axis, g.op) == (tuple(input.shape), axis, "ArgMax"):
                self.next_argmax = j + 1
                self.matched += 1
                _, kept = self._impose(g, input, None, kept)
                break
        return kept if keepdim else kept.squeeze(axis)

    def batched_nms(self, boxes, scores, idxs, iou_threshold):
        import torch

        keep = self.suppress(boxes, scores, idxs, iou_threshold)
        for j in range(self.next_suppression, len(self.suppressions)):
            g = self.suppressions[j]
            if len(g.scores) == int(boxes.shape[0]):
                self.next_suppression = j + 1
                self.matched += 1
                mine = keep.cpu().numpy()
                if np.array_equal(mine, g.keep):
                    return keep
                pick = self._suppression(g, *(t.detach().cpu().double().numpy() for t in (boxes, scores, idxs)),
                                         float(iou_threshold), mine)
                self.found.append(pick)
                return torch.as_tensor(g.keep, dtype=keep.dtype, device=keep.device) if pick.tied else keep
        return keep

    def comparison(self, op: str, x, other):
        """`x <op> other` (Tensor.__lt__ and its kin): matched, in order, to the next graph threshold of the same
        shape, op and constant; where the results differ, the graph's is imposed if its compared values stand within
        `tolerances` of eager's and every position that flipped lies, in eager's values, no further from the
        threshold than twice the graph's largest difference there: float noise put it on the other side."""
        result = self.compare[op](x, other)
        if not (isinstance(other, (int, float)) and getattr(x, "is_floating_point", lambda: False)()):
            return result
        for j in range(self.next_threshold, len(self.thresholds)):
            g = self.thresholds[j]
            if (g.op, np.float32(g.threshold)) != (op, np.float32(other)):
                continue
            copies = 1 if g.shape == tuple(x.shape) else _copies(x, g.shape)
            if not copies:
                continue
            self.next_threshold = j + 1
            self.matched_thresholds += 1
            if copies == 1:
                return self._threshold(g, x, result)
            split = (g.shape[0], copies, *g.shape[1:])  # eager compares copies of what the graph compares once
            once = self._threshold(g, x.reshape(split)[:, 0], result.reshape(split)[:, 0])
            return once[:, None].expand(split).reshape(result.shape)
        return result

    def _threshold(self, g: _GraphThreshold, x, result):
        import torch

        mine = result.detach().cpu().numpy()
        if np.array_equal(mine, g.result):
            return result
        if not np.array_equal(_COMPARE[g.op](g.values, np.float32(g.threshold)), g.result):
            return self._refuse(g, None, result, "the graph's result is not its own values compared")[1]
        eager = x.detach().cpu().double().numpy()
        noise, ok = self.tolerances.within(eager, g.values)
        flipped = mine != g.result
        if not ok or self.tolerances.past(eager, g.values)[flipped].any():
            return self._refuse(g, None, result, _not_noise(noise))[1]
        gap = float(np.abs(eager - g.threshold)[flipped].max())
        self.found.append(Pick(g.node, int(flipped.sum()), gap, 2 * float(_difference(eager, g.values)[flipped].max())))
        if not self.found[-1].tied:
            return result
        return torch.as_tensor(g.result, device=result.device)

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
        theirs = np.moveaxis(g.values, axis, -1)
        noise, ok = self.tolerances.within(rows, theirs)
        if not ok:
            return self._refuse(g, values, indices, _not_noise(noise))
        ve, vp = np.take_along_axis(rows, e, -1), np.take_along_axis(rows, p, -1)
        differs = e != p
        noise_at = _difference(rows, theirs)
        swapped = np.concatenate([np.take_along_axis(noise_at, i, -1)[differs] for i in (e, p)])  # those it concerns
        past = self.tolerances.past(rows, theirs)
        if any(np.take_along_axis(past, i, -1)[differs].any() for i in (e, p)):  # `max_mismatch` spares candidates
            # no pick depends on, never one that was swapped
            return self._refuse(g, values, indices, _not_noise(float(swapped.max())))
        self.found.append(Pick(g.node, int(differs.sum()), float(_difference(vp, ve)[differs].max()),
                               2 * float(swapped.max())))
        if not self.found[-1].tied:
            return values, indices
        pinned = torch.as_tensor(g.indices, dtype=indices.dtype, device=indices.device)
        return torch.take_along_dim(x, pinned, dim=axis), pinned

    def _suppression(self, g: _GraphSuppression, boxes, scores, classes, threshold: float, mine) -> Pick:
        theirs = g.boxes.copy()
        for c in np.unique(classes):  # the graph's boxes come offset by class, by its own largest coordinate: IoU
            of = classes == c  # within a class is blind to a common shift, so each class's is taken out
            theirs[of] -= np.median(theirs[of] - boxes[of])
        shift, boxes_ok = self.tolerances.within(boxes, theirs, pixels=True)
        noise, scores_ok = self.tolerances.within(scores, g.scores)
        positions = _differing(mine, g.keep)
        if not (boxes_ok and scores_ok):
            return Pick(g.node, positions, float("inf"), 0.0, _not_noise(noise if boxes_ok else shift))
        gap, why = _suppression_gap(boxes, scores, classes, threshold, g.keep, shift)
        return Pick(g.node, positions, gap, 2 * noise, why)

    def _refuse(self, g, values, indices, why: str):
        self.found.append(Pick(g.node, 0, float("inf"), 0.0, why))
        return values, indices


def _copies(x, shape: tuple) -> int:
    """How many equal copies of a graph threshold's [n, *rest] values eager's x holds, laid out [n * copies, *rest]
    (Mask2Former's attention masks: eager compares the mask probabilities repeated per head, the graph once per
    query, d2export/patching/masked_decoder.py); 0 where x is not that."""
    if len(shape) != x.dim() or not shape or tuple(x.shape[1:]) != tuple(shape[1:]) or not shape[0] \
            or x.shape[0] % shape[0] or x.shape[0] == shape[0]:
        return 0
    copies = x.shape[0] // shape[0]
    split = x.reshape(shape[0], copies, *shape[1:])
    return copies if bool((split == split[:, :1]).all()) else 0


def _not_noise(difference: float) -> str:
    return (f"the graph's candidates stand up to {difference:.2g} from eager's, past the tolerance of the outputs: "
            "not float noise")


def _differing(mine: np.ndarray, theirs: np.ndarray) -> int:
    """Slots of two selections holding different candidates (a longer one's extra slots count)."""
    n = min(len(mine), len(theirs))
    return int((mine[:n] != theirs[:n]).sum()) + abs(len(mine) - len(theirs))


def _suppression_gap(boxes, scores, classes, threshold: float, keep: np.ndarray, shift: float) -> tuple[float, str]:
    """Whether `keep` is what greedy NMS (per class; IoU past `threshold` suppresses) gives on these boxes and
    scores once every coordinate may move by `shift`. Greedy NMS's answer is the one set where the kept boxes of a
    class overlap at most `threshold`, every dropped box overlaps past it a kept box of its class scoring at least as
    high, and the kept come in falling score. Returns (gap, why): the largest score deficit those conditions needed
    (a later kept box scoring higher; a dropped box scoring higher than every kept one that may suppress it), and why
    `keep` is no such answer whatever the scores ('' when it may be)."""
    n = len(scores)
    if keep.size and (keep.min() < 0 or keep.max() >= n):
        return float("inf"), "the graph's indices lie outside the candidates"
    if len(np.unique(keep)) != len(keep):
        return float("inf"), "the graph kept a candidate twice"
    gap = float(max(np.diff(scores[keep]).max(initial=0.0), 0.0))
    dropped = np.setdiff1d(np.arange(n), keep)
    for c in np.unique(classes):
        kept, out = keep[classes[keep] == c], dropped[classes[dropped] == c]
        least, _ = _iou_bounds(boxes[kept], boxes[kept], shift)
        np.fill_diagonal(least, 0.0)
        if (least > threshold).any():
            return float("inf"), "two kept boxes of a class overlap past the IoU threshold beyond float noise"
        if not out.size:
            continue
        _, most = _iou_bounds(boxes[kept], boxes[out], shift)
        deficit = np.where(most > threshold, np.maximum(scores[out][None] - scores[kept][:, None], 0.0), np.inf)
        if not kept.size or np.isinf(deficit.min(axis=0)).any():
            return float("inf"), "a dropped box overlaps no kept box of its class past the IoU threshold"
        gap = max(gap, float(deficit.min(axis=0).max()))
    return gap, ""


def _iou_bounds(a: np.ndarray, b: np.ndarray, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """The least and the most IoU of each box of `a` with each of `b` (x0, y0, x1, y1) when every coordinate may move
    by `shift`."""
    out = np.array([-shift, -shift, shift, shift])

    def inter(p, q):
        w = np.minimum(p[:, None, 2], q[None, :, 2]) - np.maximum(p[:, None, 0], q[None, :, 0])
        h = np.minimum(p[:, None, 3], q[None, :, 3]) - np.maximum(p[:, None, 1], q[None, :, 1])
        return np.clip(w, 0, None) * np.clip(h, 0, None)

    def area(p):
        return np.clip(p[:, 2] - p[:, 0], 0, None) * np.clip(p[:, 3] - p[:, 1], 0, None)

    grown_a, grown_b, shrunk_a, shrunk_b = a + out, b + out, a - out, b - out
    most_inter, least_inter = inter(grown_a, grown_b), inter(shrunk_a, shrunk_b)
    least_union = np.maximum(area(shrunk_a)[:, None] + area(shrunk_b)[None] - most_inter, most_inter)
    most_union = area(grown_a)[:, None] + area(grown_b)[None] - least_inter
    with np.errstate(divide="ignore", invalid="ignore"):
        most = np.where(least_union > 0, np.minimum(most_inter / least_union, 1.0), 0.0)
        least = np.where(most_union > 0, least_inter / most_union, 0.0)
    return least, most


def _batched_nms_as_traced(boxes, scores, idxs, iou_threshold: float):
    """torchvision's batched NMS as it is traced (in eager, past a size, it loops over classes instead: the same
    answer but for ties): one NMS over boxes offset by class so that no two classes overlap."""
    import torch
    import torchvision.ops

    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    offsets = idxs.to(boxes) * (boxes.max() + 1)
    return torchvision.ops.nms(boxes + offsets[:, None], scores, iou_threshold)


@contextlib.contextmanager
def pinned_selections(picks: list, tolerances: Tolerances) -> Iterator[_Pinner]:
    """Scoped: torch.topk, Tensor.topk and torchvision's batched_nms impose the graph's picks (see `_Pinner`);
    restored on exit."""
    import torch
    import torchvision.ops
    import torchvision.ops.boxes as boxes

    operators = {op: getattr(torch.Tensor, f"__{op}__") for op in _COMPARE}
    pinner = _Pinner(picks, tolerances, torch.topk, _batched_nms_as_traced, operators, torch.argmax)
    method = lambda self, *a, **kw: pinner(self, *a, **kw)  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch, "topk", pinner))
        stack.enter_context(mock.patch.object(torch.Tensor, "topk", method))
        if any(p.op == "ArgMax" for p in pinner.picks):
            stack.enter_context(mock.patch.object(torch, "argmax", pinner.argmax))
            stack.enter_context(mock.patch.object(torch.Tensor, "argmax",
                                                  lambda self, *a, **kw: pinner.argmax(self, *a, **kw)))
        stack.enter_context(mock.patch.object(boxes, "batched_nms", pinner.batched_nms))
        stack.enter_context(mock.patch.object(torchvision.ops, "batched_nms", pinner.batched_nms))
        if pinner.thresholds:  # comparison operators answer through the pinner only where the graph thresholds
            for op in operators:
                stack.enter_context(mock.patch.object(torch.Tensor, f"__{op}__", _comparing(pinner, op)))
        yield pinner


def _comparing(pinner: _Pinner, op: str):
    return lambda self, other: pinner.comparison(op, self, other)


def pin_case(case, session, nodes, names: Sequence[str], output_names: Sequence[str],
             rerun: Callable[[object], list], judge: Callable[[str, dict, dict], tuple[list, bool]],
             tolerances: Tolerances) -> PinnedCase:
    """One failed case again, with the graph's selections imposed on eager where they differ only by float noise.
    `rerun(case)`: eager outputs in output order; `judge(case, expected, actual)`: (comparisons, ok) with the
    normal tolerances, which `tolerances` repeats for the candidates."""
    values, picks = graph_picks(session, nodes, names, case.inputs)
    with pinned_selections(picks, tolerances) as pinner:
        expected = dict(zip(output_names, rerun(case)))
    result = PinnedCase(case.name, pinner.found)
    refused = [p for p in pinner.found if not p.tied]
    selects = pinner.picks or pinner.suppressions  # a TopK or NMS unmatched says more than thresholds that matched
    if not (pinner.matched if selects else pinner.matched_thresholds):
        result.why = ("no torch.topk, batched NMS or comparison of eager's matches a TopK (selected shape, k, axis), "
                      "an NMS (boxes) or a threshold (shape, op, constant) of the graph: the graph does not select "
                      "what eager selects")
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
    return (f"a candidate picked {p.gap:.2g} away (in eager's values) from eager's pick, past the near-tie bound "
            f"{p.bound:.2g} (twice the graph's largest difference from eager at the candidates)")


def pin_cases(copy: near_ties.SelectingCopy, cases, output_names: Sequence[str], rerun, judge,
              tolerances: Tolerances) -> list[PinnedCase]:
    """`pin_case` for each of `cases` (the failed ones) on the graph `copy` opens."""
    session, nodes = copy.opened
    if not nodes:
        return [PinnedCase(c.name, why="the graph makes no selection (TopK, NMS, threshold)") for c in cases]
    names = [o.name for o in session.get_outputs()]
    return [pin_case(c, session, nodes, names, output_names, rerun, judge, tolerances) for c in cases]


def with_pinned(results: list, pinned: list) -> list:
    """`results` with the comparisons of each case that pinning cleared replaced by those made after pinning."""
    cleared = {p.case: p.comparisons for p in pinned if p.ok}
    kept = [r for r in results if r.case not in cleared]
    return kept + [c for comparisons in cleared.values() for c in comparisons]


def unpinned_lines(summary: dict) -> str:
    """For a failed verification: why pinning did not clear each case it was tried on."""
    return "".join(f"\n{p['case']}: pinning did not clear the case: {p['why']}"
                   for p in summary.get("pinned", []) if not p["ok"])
