"""What a graph is verified on: the verification sizes (rounded up to the multiples a model's own code needs, where it
refuses the defaults) and the cases made at them, with eager PyTorch's outputs as the independent side."""
from __future__ import annotations

import itertools
import logging
from typing import Sequence

from d2export import progress
from d2export.config import D2ExportConfig
from d2export.verification import served_masks, comparison
from d2export.exporting.onnx_export import traced_sizes
from d2export.verification.pictures import picture_at, picture_files
from d2export.verification.size_refusals import _innermost, model_size_error
from d2export.stage_errors import describe
from d2export.tracing import dummy_images, graph_inputs

log = logging.getLogger("d2export")


def verification_sizes(cfg: D2ExportConfig, divisibility: int = 0) -> list[tuple[int, int]]:
    """The dummy size, its transpose, a non-square size and its transpose (same token count, other aspect ratio —
    where a baked shape goes silently wrong), and an odd size; or what the config lists; a fixed-size graph's own.
    `divisibility` (a model whose own code runs only at multiples of it, `size_divisibility`): the defaults rounded up
    to its multiples, as the runtime pads pictures."""
    if cfg.verify.sizes:
        return [tuple(s) for s in cfg.verify.sizes]
    if not cfg.export.dynamic:  # the graph takes no other
        return list(dict.fromkeys(traced_sizes(cfg)))
    h, w = cfg.export.dummy_sizes[0]
    r = lambda v: max(64, int(round(v / 16)) * 16)  # noqa: E731
    c = (r(h * 0.8), r(w * 1.25))
    candidates = [(h, w), (w, h), c, (c[1], c[0]), (h + 13, w - 7)]
    return rounded_up(candidates, divisibility) if divisibility else list(dict.fromkeys(candidates))


# the multiples a model's own code may need its input in (ViTAEv2: 32, the product of its strides), least first
DIVISIBILITIES = (8, 16, 32, 64, 128)


def rounded_up(sizes: Sequence[Sequence[int]], divisibility: int) -> list[tuple[int, int]]:
    """Each (height, width) up to multiples of `divisibility` (where the runtime pads it to), duplicates dropped:
    rounding both axes alike keeps transposes transposes."""
    up = lambda v: -(-int(v) // divisibility) * divisibility  # noqa: E731
    return list(dict.fromkeys((up(h), up(w)) for h, w in sizes))


class _RefusedAt(Exception):
    """The eager reference refused a case's size with the model's own size error (`model_size_error`)."""

    def __init__(self, group: list[tuple[int, int]], error: BaseException):
        super().__init__(str(error))
        self.group, self.error = group, error


def verification_cases(built) -> list[comparison.Case]:
    """The cases at the verification sizes (`_cases_at`). Where the model's own code refuses one of the default
    sizes with its own size error (ViTAEv2 runs only at multiples of 32), the least of DIVISIBILITIES it runs at is
    found, the cases are made at the sizes rounded up to it, and `built.size_divisibility` says it (the manifest
    records it and the runtime pads pictures to it; `built.size_choice`: which sizes, and why). Sizes the user gave
    (`verify.sizes`) are checked as given: one the model refuses stays an error, as does any other failure, and a
    refusal no divisibility cures (the model's own error, raised again)."""
    defaults = sizes = verification_sizes(built.cfg)
    searching = built.cfg.export.dynamic and not built.cfg.verify.sizes
    divisibility, first = 0, None
    while True:
        try:
            cases = _cases_at(built, sizes, refusal=searching)
            break
        except _RefusedAt as refused:
            first = first or refused
            divisibility = _divisibility(built, refused.group, divisibility, first.error)
            sizes = verification_sizes(built.cfg, divisibility)
    built.size_divisibility, built.size_choice = divisibility, {}
    if divisibility:
        (h, w), e = first.group[0], first.error
        said = describe(e) or f"{type(e).__name__}: {_first_line(e)} ({_innermost(e)})"
        why = f"the model's own code refuses {h}x{w} ({said}) and runs at multiples of {divisibility}"
        log.warning("verification sizes %s, not %s: %s; served pictures are padded to multiples of %d",
                    _listed(sizes), _listed(defaults), why, divisibility)
        built.size_choice = {"size_divisibility": divisibility, "sizes": [list(s) for s in sizes],
                             "defaults": [list(s) for s in defaults], "why": why}
    return cases


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _listed(sizes) -> str:
    return ", ".join(f"{h}x{w}" for h, w in sizes)


def _divisibility(built, group: list[tuple[int, int]], above: int, error: BaseException) -> int:
    """The least of DIVISIBILITIES above `above` at whose multiples the model's own code runs the refused `group`
    (one eager run each: cheap; the other sizes are held to it when the cases are made, and a refusal there asks
    again from it). Raises the model's own first `error` where none does."""
    for d in (d for d in DIVISIBILITIES if d > above):
        probe = rounded_up(group, d)
        if probe == rounded_up(group, above or 1):  # the same sizes that were just refused
            continue
        try:
            built.adapter.reference(dummy_images(probe, seed=3000))
            return d
        except Exception as e:  # noqa: BLE001 — the model's size error: the next multiple; anything else raised
            if not model_size_error(e):
                raise
    log.error("the model's own code refuses %s at multiples of %s too: no size divisibility makes it run",
              _listed(group), ", ".join(map(str, DIVISIBILITIES)))
    raise error


def _cases_at(built, sizes: list[tuple[int, int]], refusal: bool = False) -> list[comparison.Case]:
    """One case per verification size (and a batch of two where the graph takes one), with eager's outputs: computed
    before any export-time patch, they are the independent side. The pictures are synthetic (bars, strokes, noise),
    or with `verify.pictures` the model's own, one after another, each stretched to its case's size. `refusal`: a
    size the model's own code refuses raises _RefusedAt (the caller looks for the sizes it takes)."""
    groups: list[list[tuple[int, int]]] = [[s] for s in sizes]
    if not built.cfg.export.dynamic and not built.cfg.verify.sizes:
        # a fixed-size graph takes the traced batch and size only: other pictures of that shape, twice
        groups = [traced_sizes(built.cfg, built.adapter.batchable)] * 2
    elif built.cfg.verify.batch and built.adapter.batchable:
        groups.append([sizes[0], sizes[2 if len(sizes) > 2 else -1]])
    elif built.cfg.verify.batch:
        log.warning("verify.batch: no batch case, the %s graph takes one image per run (fixed batch axis)",
                    built.family.name)
    v, cases = built.cfg.verify, []
    files = picture_files(v.pictures, sum(map(len, groups)), "verify.pictures") if v.pictures else []
    turns = itertools.cycle(files)  # one picture a case's image, in turn
    pixel_format = built.family.preprocess(built.d2cfg)["input_format"]
    own = served_masks.start(built)  # segmenters: what is served held to the model's own inference
    for i, group in progress.steps(list(enumerate(groups)), "eager references"):
        name = ("batch " if len(group) > 1 else "") + "+".join(f"{h}x{w}" for h, w in group) + (
            f" (pictures {i + 1})" if groups.count(group) > 1 else "")
        if files:
            used = [next(turns) for _ in group]
            images = [picture_at(f, h, w, pixel_format) for f, (h, w) in zip(used, group)]
            name += f" ({'+'.join(f.name for f in used)})"
        else:
            images = dummy_images(group, seed=1000 + 10 * i)
        try:
            expected = built.adapter.reference(images)
        except Exception as e:  # noqa: BLE001 — the model's own size limit is looked into; anything else raised
            if refusal and model_size_error(e):
                raise _RefusedAt(group, e) from e
            raise
        if own is not None:
            served_masks.hold(built, expected, images, own)
        cases.append(comparison.Case(name, graph_inputs(built.adapter, images), expected, images))
    return cases
