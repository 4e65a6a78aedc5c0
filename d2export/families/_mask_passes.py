"""Mask post-processing's per-pixel passes, numpy only: the upsampled masks made a band of rows at a time, each task's
pass over a band (panoptic's competition, instance masks and their sums, the semantic argmax) and the threads the bands
run on, so a band is made, used and dropped in cache and no [Q, H, W] stack is ever whole. The semantic map is first
decided a cell at a time where bounds on the cell's mask logits settle it (`_bounded`), and made per pixel elsewhere."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
from threadpoolctl import ThreadpoolController

from d2export.families._mask_resize import Taps, _along, _taps, _then
from d2export.families._mask_rules import sigmoid

_BAND = 1 << 19  # float32 elements of mask probabilities per band of rows: a band is made, used and dropped in cache
# Class probabilities below float32's normal range (a softmax over logits 87+ apart: seeded weights make thousands)
# cost 40-80x a multiply on Intel cores (microcode assists; on AMD's barely more): the semantic product of 640² took
# 7.7 s instead of 0.1. Lifted by 2^LIFT, both factors are normal; products and sums round exactly as the unlifted
# ones wherever those are normal (a power of two commutes with rounding) and better where those underflow (scores
# under 1e-38, whose order the 1e-4 tie rule already leaves to noise); the argmax is the same. (The graph's product,
# export.postprocess=graph, stays unlifted: verification pins its ArgMax by absolute gaps; GPUs take subnormals.)
# A product by 2^LIFT is the lift: exact for every float32 up to 1, and a tenth of np.ldexp's time (a libm call per
# element; 13 ms of a 2.6 M-element band on an AMD EPYC, more than the band's product).
LIFT = 48
_LIFTED = np.float32(2.0 ** LIFT)


def _first_max(values) -> np.ndarray:
    """argmax over a sequence of equal-shaped arrays (the first on ties, as torch's argmax), as int32: a running
    maximum, 3x faster than ndarray.argmax(0) (which copies to make axis 0 the last) and never the stack in memory."""
    values = iter(values)
    best = np.array(next(values), np.float32)
    index = np.zeros(best.shape, np.int32)
    for i, v in enumerate(values, 1):
        better = v > best
        index[better] = i
        np.maximum(best, v, out=best)
    return index


class Upsampled:
    """A picture's mask logits [Q, H, W] as F.interpolate (bilinear, align_corners=False) makes them from the graph's
    [Q, h, w], made a band of rows at a time: the columns resized once, each band's rows from the few input rows it
    reads."""

    def __init__(self, masks: np.ndarray, rows: Taps | None, cols: Taps | None):
        masks = self.masks = np.asarray(masks, np.float32)
        self.cols = cols
        if cols is None:
            self.columns = masks  # [Q, h, W]
        else:
            self.columns = np.empty((*masks.shape[:-1], len(cols[0])), np.float32)
            parts = np.array_split(np.arange(len(masks)), min(len(masks), 8))
            _each(lambda q: _along(masks[q[0] : q[-1] + 1], cols, -1, self.columns[q[0] : q[-1] + 1]), parts)
        self.rows = rows
        q, h, w = self.columns.shape
        self.shape = (q, h if rows is None else len(rows[0]), w)

    def logits(self, start: int, stop: int) -> np.ndarray:
        return _band(self.columns, self.rows, start, stop)

    def probs(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of the probabilities, and of the logits."""
        logits = self.logits(start, stop)
        return sigmoid(logits), logits

    def at(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """[Q, n] logits of the pixels (rows[i], cols[i]): the row taps gathered from the flattened columns, summed
        as a band's rows are (_along)."""
        flat, width = self.columns.reshape(len(self.columns), -1), self.columns.shape[2]
        index, weight = self.rows or _identity(self.columns.shape[1])
        return _along(flat, (index[rows] * width + cols[:, None], weight[rows]), -1)

    def whole(self) -> np.ndarray:
        return self.logits(0, self.shape[1])

    def bands(self) -> list[tuple[int, int]]:
        q, h, w = self.shape
        step = max(1, _BAND // (q * w))
        return [(s, min(s + step, h)) for s in range(0, h, step)]


def _band(x: np.ndarray, rows: Taps | None, start: int, stop: int) -> np.ndarray:
    """Output rows [start, stop) of resizing x [Q, h, W] along its rows."""
    if rows is None:
        return x[:, start:stop]
    index, weight = (t[start:stop] for t in rows)
    first = int(index.min())
    return _along(x[:, first : int(index.max()) + 1], (index - first, weight), -2)


def _masks_at(masks: np.ndarray, padded_hw: tuple[int, int], crop_hw: tuple[int, int] | None = None,
              out_hw: tuple[int, int] | None = None) -> np.ndarray:
    """Mask logits upsampled to the padded size, or (given `crop_hw` and `out_hw`) that cropped to `crop_hw` and
    resized to `out_hw` (sem_seg_postprocess) in one pass: the padded-size masks are never made."""
    (ph, pw), (mh, mw) = padded_hw, masks.shape[-2:]
    if crop_hw is None:
        return Upsampled(masks, _taps(mh, ph), _taps(mw, pw)).whole()
    (ch, cw), (oh, ow) = crop_hw, out_hw
    return Upsampled(masks, _then(mh, ph, ch, oh), _then(mw, pw, cw, ow)).whole()


_pool: tuple[int, ThreadPoolExecutor] | None = None
_blas: ThreadpoolController | None = None


def _one_blas_thread():
    """A scope in which BLAS runs on one thread (threadpoolctl; the loaded libraries are looked up once)."""
    global _blas
    _blas = _blas or ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


def _each(fn: Callable, items: list) -> list:
    """fn over items on a thread per core (numpy lets go of the GIL in its array loops); a pool per process, as one
    made before a fork does not run in the child."""
    global _pool
    if len(items) < 2:
        return [fn(x) for x in items]
    if _pool is None or _pool[0] != os.getpid():
        _pool = os.getpid(), ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="d2export-masks")
    return list(_pool[1].map(fn, items))


class _Competition:
    """Panoptic's per-pixel competition of the kept queries (`keep`, scored `scores`), a band at a time: the winner
    (first of the highest score × probability, as torch's argmax) and whether its own mask covers the pixel; per kept
    query its pixels won, its mask's pixels (probability >= 0.5) and the pixels it won and covers."""

    def __init__(self, keep: np.ndarray, scores: np.ndarray, hw: tuple[int, int]):
        self.keep, self.scores = keep, scores
        self.winner, self.inside = np.zeros(hw, np.int32), np.zeros(hw, bool)

    def band(self, start: int, stop: int, probs: np.ndarray, logits: np.ndarray) -> np.ndarray:
        masks = probs[self.keep]
        winner = self.winner[start:stop] = _first_max(score * mask for score, mask in zip(self.scores, masks))
        inside = self.inside[start:stop] = np.take_along_axis(masks, winner[None], 0)[0] >= 0.5
        k = len(self.keep)
        return np.stack([np.bincount(winner.ravel(), minlength=k),
                         np.count_nonzero((masks >= 0.5).reshape(k, -1), axis=1),
                         np.bincount(winner[inside], minlength=k)])


class _MaskScores:
    """Instance masks (logit > 0) of the picked queries and the sums of their mean probability over them, a band at a
    time. `alone`: the field holds the picked queries only (in `queries`' order), not every query."""

    def __init__(self, queries: np.ndarray, hw: tuple[int, int], alone: bool = False):
        self.queries = queries
        self.rows = slice(None) if alone else queries  # the picked queries' rows in the field
        self.positive = np.zeros((len(queries), *hw), bool)

    def band(self, start: int, stop: int, probs: np.ndarray, logits: np.ndarray) -> np.ndarray:
        n = len(self.queries)
        positive = self.positive[:, start:stop] = logits[self.rows] > 0
        inside = probs[self.rows].reshape(n, -1)
        inside *= positive.reshape(n, -1)
        return np.stack([inside.sum(1).astype(np.float64), np.count_nonzero(positive.reshape(n, -1), axis=1)])


class _SemanticMap:
    """semantic_inference's argmax (the first highest class, as torch's), a band at a time; with `margins`, also
    whether each pixel's class leads every other by more than float32 rounding can move a sum over the queries
    (`decided`: the argmax of any weighted mean of such pixels' scores is theirs, see semantic_resized)."""

    def __init__(self, classes: np.ndarray, hw: tuple[int, int], margins: bool = False):
        self.classes = np.asarray(classes, np.float32) * _LIFTED  # [Q, K]: Rules.semantic
        self.map = np.zeros(hw, np.int32)
        self.decided = np.zeros(hw, bool) if margins else None
        # a sum of Q positive float32 terms is within Q units in the last place of its exact value, however summed:
        # two classes' sums, ours and upstream's, differ by at most four times that
        self.tolerance = np.float32(4 * len(self.classes) * 2.0 ** -24)

    def scores(self, probs: np.ndarray) -> np.ndarray:
        """[Q, n] mask probabilities → [n, K] class scores (lifted): the argmax along contiguous memory."""
        return (probs * _LIFTED).T @ self.classes

    def lead(self, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """[Q, n] mask probabilities → each pixel's class, and (with margins) whether it is decided."""
        scores = self.scores(probs)
        best = scores.argmax(-1)
        if self.decided is None:
            return best, None
        top, other = _top_and_other(scores, best)
        return best, top - other > self.tolerance * top

    def band(self, start: int, stop: int, probs: np.ndarray, logits: np.ndarray | None) -> None:
        q, rows, w = probs.shape
        best, decided = self.lead(probs.reshape(q, -1))
        self.map[start:stop] = best.reshape(rows, w)
        if decided is not None:
            self.decided[start:stop] = decided.reshape(rows, w)

    def pixels(self, field: Upsampled, ys: np.ndarray, xs: np.ndarray) -> None:
        """The class (and margin) of the pixels (ys, xs) alone, a few at a time on threads."""
        def run(part: slice) -> None:
            best, decided = self.lead(sigmoid(field.at(ys[part], xs[part])))
            self.map[ys[part], xs[part]] = best
            if decided is not None:
                self.decided[ys[part], xs[part]] = decided

        step = max(1, _BAND // len(self.classes))
        with _one_blas_thread():
            _each(run, [slice(s, s + step) for s in range(0, len(ys), step)])


def _top_and_other(scores: np.ndarray, best: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, K] scores → each row's score at `best`, and the greatest of its others (scores left as they were)."""
    rows = np.arange(len(best))
    top = scores[rows, best]
    scores[rows, best] = -np.inf
    other = scores.max(-1)
    scores[rows, best] = top
    return top, other


def semantic_resized(field: Upsampled, classes: np.ndarray, rows: Taps | None, cols: Taps | None) -> np.ndarray:
    """sem_seg_postprocess's resize of semantic_inference's scores (bilinear, from the field's size), then their
    argmax, without resizing K score maps: the argmax is made at the field's size, with margins. An output pixel
    whose taps all read one class, decided at each, takes it: a weighted mean (weights >= 0) of score vectors that
    one class leads is led by it. Only the others (class borders, near ties) get their resized scores. The field's
    classes are decided a cell at a time where `_bounded` can, each pixel's own scores made elsewhere."""
    semantic = _SemanticMap(classes, field.shape[1:], margins=rows is not None or cols is not None)
    bounded = _bounded(field, semantic)
    if bounded is None:
        _per_pixel(field, semantic)
    else:  # the pixels of cells no bound decides, one by one
        semantic.pixels(field, *np.nonzero(~bounded))
    if semantic.decided is None:
        return semantic.map
    (ri, rw), (ci, cw) = (t if t is not None else _identity(n) for t, n in zip((rows, cols), field.shape[1:]))
    resized = semantic.map[ri[:, :1], ci[:, 0]]  # each output pixel's first tap's class
    ys, xs = np.nonzero(~_sure(semantic, ri, ci, resized))
    resized[ys, xs] = _border_classes(field, semantic, (ri, rw), (ci, cw), ys, xs)
    return resized


def _windows(taps: Taps | None, size: int) -> tuple[np.ndarray, int] | None:
    """Per output, the start of the window of k consecutive inputs holding its taps, and k; None where the taps are
    not such windows or a weight is negative (a bound needs outputs inside their inputs' range)."""
    index, weight = taps if taps is not None else _identity(size)
    k = min(index.shape[1], size)
    start = np.minimum(index[:, 0], size - k)  # _taps' last outputs read (size-1, size-1): inside (size-2, size-1)
    if (weight < 0).any() or ((index < start[:, None]) | (index >= start[:, None] + k)).any():
        return None
    return start, k


def _over_windows(reduce: np.ufunc, x: np.ndarray, k: int, axis: int) -> np.ndarray:
    """reduce (np.minimum, np.maximum) of x over every window of k consecutive entries along axis."""
    def window(j: int) -> np.ndarray:
        return x[(slice(None),) * axis + (slice(j, x.shape[axis] - k + 1 + j),)]

    out = window(0).copy()
    for j in range(1, k):
        reduce(out, window(j), out=out)
    return out


# A bilinear output lies within its taps' range up to a few units in the last place of float32, the sigmoid of a
# bound within a few more: both are widened by far more than that (2^-16), which the cells a class leads never miss.
_SLACK = np.float32(2.0 ** -16)


def _bounded(field: Upsampled, semantic: _SemanticMap) -> np.ndarray | None:
    """[H, W]: the pixels whose class and margin are set from a bound, their cell's (the pixels reading one window of
    mask rows and columns). A mask probability at such a pixel lies between the sigmoids of the window's least and
    greatest logit. Over that box, class c's score leads class k's by at least the sum over queries of (c's weight -
    k's) times the least probability where that is positive, the greatest where negative: a query's weights move both
    scores together, so this is far tighter than c's least score against k's greatest (tried first: enough inside a
    trained model's regions, not in seeded weights' noise). Where c's lead over every other class is beyond twice the
    margin (a pixel's own sums may sit Q units in the last place off the exact ones), each pixel of the cell finds c,
    decided, as `band` would: most cells of a map, for a few products per cell in place of one per pixel. None where
    the taps are not windows or a class weight is negative or not a number (every rule's weights are
    probabilities)."""
    (q, h, w), classes = field.masks.shape, semantic.classes
    rows, cols = _windows(field.rows, h), _windows(field.cols, w)
    if rows is None or cols is None or not (classes >= 0).all():  # a negative weight turns the box's bounds over
        return None

    def probabilities(reduce: np.ufunc, sign: int) -> np.ndarray:
        """[cells, Q]: each cell's least (sign -1) or greatest (+1) mask probability (lifted), widened."""
        logits = _over_windows(reduce, _over_windows(reduce, field.masks, rows[1], 1), cols[1], 2)
        logits += sign * _SLACK * (1 + np.abs(logits))
        probs = sigmoid(logits) * (_LIFTED * (1 + sign * _SLACK))
        return np.ascontiguousarray(probs.reshape(q, -1).T)

    def coupled(over: np.ndarray) -> np.ndarray:  # the least leads of best[over] (one class) over each class
        d = classes[:, best[over[0]], None] - classes  # sign-exact: the difference of two floats
        return least[over] @ np.maximum(d, 0) + most[over] @ np.minimum(d, 0)

    # a lead made of c's scores and k's (or of their weights' differences) may be off the exact one by (2Q + 4) units
    # in the last place of own + high, the differences' and the products' rounding: taken off
    rounding = np.float32(2.0 ** -22 * (q + 2))

    def settled(over: np.ndarray, leads: np.ndarray) -> np.ndarray:
        own = high[over, best[over]]
        leads -= rounding * (own[:, None] + high[over])
        leads[np.arange(len(over)), best[over]] = np.inf
        return leads.min(-1) > 2 * semantic.tolerance * own

    with _one_blas_thread():
        least, most = _each(lambda bound: probabilities(*bound), [(np.minimum, -1), (np.maximum, 1)])
        low, high = _each(lambda probs: probs @ classes, [least, most])
        best = low.argmax(-1)
        own, other = _top_and_other(high, best)  # first c's least score against the greatest of any other class
        sure = low[np.arange(len(best)), best] - rounding * (own + other) - other > 2 * semantic.tolerance * own
        # the lead over the box is at most the lead at its greatest corner: where that is short, so is the box's
        hopeless = own - other <= 2 * semantic.tolerance * own
        loose = [over[~(sure | hopeless)[over]] for over in (np.flatnonzero(best == c) for c in np.unique(best))]
        loose = [over for over in loose if len(over)]
        for over, leads in zip(loose, _each(coupled, loose)):
            sure[over] = settled(over, leads)
    sure = sure.reshape(h - rows[1] + 1, w - cols[1] + 1)
    cell = np.ix_(rows[0], cols[0])  # each pixel's cell
    bounded = sure[cell]
    semantic.map[bounded] = best.reshape(sure.shape)[cell][bounded]
    if semantic.decided is not None:
        semantic.decided[bounded] = True
    return bounded


def _sure(semantic: _SemanticMap, ri: np.ndarray, ci: np.ndarray, first: np.ndarray) -> np.ndarray:
    """[H, W]: whether every tap of the output pixel reads the class `first`, decided there."""
    sure = np.ones(first.shape, bool)
    for a in range(ri.shape[1]):
        for b in range(ci.shape[1]):
            tap = (ri[:, a : a + 1], ci[:, b])
            sure &= semantic.decided[tap] & (semantic.map[tap] == first)
    return sure


def _border_classes(field: Upsampled, semantic: _SemanticMap, rows: Taps, cols: Taps, ys: np.ndarray,
                    xs: np.ndarray) -> np.ndarray:
    """The argmax of the resized scores at output pixels (ys, xs), from their taps' scores made again (columns
    first, then rows, as _along sums); a few pixels at a time, on threads."""
    (ri, rw), (ci, cw), width = rows, cols, field.shape[2]

    def classes(part: np.ndarray) -> np.ndarray:
        y, x = ys[part], xs[part]
        source = ri[y][:, :, None] * width + ci[x][:, None, :]  # [n, rows' taps, cols' taps]
        pixels, back = np.unique(source, return_inverse=True)
        scores = semantic.scores(sigmoid(field.at(pixels // width, pixels % width)))[back.reshape(source.shape)]
        along_columns = scores[:, :, 0] * cw[x, 0, None, None]
        for b in range(1, ci.shape[1]):
            along_columns += scores[:, :, b] * cw[x, b, None, None]
        resized = along_columns[:, 0] * rw[y, 0, None]
        for a in range(1, ri.shape[1]):
            resized += along_columns[:, a] * rw[y, a, None]
        return resized.argmax(-1)

    step = max(1, _BAND // (semantic.classes.shape[1] * ri.shape[1] * ci.shape[1]))  # scores per part: a band's
    parts = [np.arange(s, min(s + step, len(ys))) for s in range(0, len(ys), step)]
    with _one_blas_thread():
        found = _each(classes, parts)
    return np.concatenate(found) if found else np.zeros(0, np.int32)


def _identity(size: int) -> Taps:
    return np.arange(size)[:, None], np.ones((size, 1), np.float32)


def _per_pixel(field: Upsampled, *passes) -> list:
    """Runs each pass over every band of `field` (threads over bands); per pass, what its bands return summed (None
    for passes returning nothing). Bands depend on sizes only: results are the same on any number of cores."""
    def run(band):
        start, stop = band
        probs, logits = field.probs(start, stop)
        return [p.band(start, stop, probs, logits) for p in passes]

    with _one_blas_thread():  # each thread's BLAS on one core: two threads' products would fight for the cores
        parts = _each(run, field.bands())
    return [None if parts[0][i] is None else sum(part[i] for part in parts) for i in range(len(passes))]
