"""Verification of a staged graph against eager PyTorch, every precision in one place: the float32 graph, each output
within its kind's tolerance (`comparison.Float32`); its float16 or int8 conversion, held to that precision's own
tolerances (`comparison.Reduced`); on a failed case, the graph's near-tied selections pinned on eager (pinning.py); on a
float32 failure, the parity ladder's first diverging module (ladder.py). The pipeline chooses what to verify and
hands a `Subject` over; nothing here calls back into it, and nothing is written if a graph is refused."""
from __future__ import annotations

import itertools
import logging
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from d2export import progress
from d2export.config import D2ExportConfig
from d2export.verification import pinning, served_masks, check_sessions, comparison
from d2export.verification.ladder import ROOT, run_ladder
from d2export.exporting.onnx_export import export_scope, traced_sizes
from d2export.verification.pictures import picture_at, picture_files
from d2export.manifest import Manifest, graph_specs
from d2export.stage_errors import describe
from d2export.tracing import dummy_images, graph_inputs

log = logging.getLogger("d2export")


@dataclass
class Subject:
    """A staged graph and what it is checked against: the cases (inputs, eager outputs) and the model they came from
    (the pipeline's `Built`: its config and family say the tolerances, its adapter reruns failed cases eagerly with
    the graph's selections pinned, and the parity ladder re-exports it)."""

    built: object
    path: Path
    cases: Sequence[comparison.Case]

    @property
    def output_names(self) -> list[str]:
        return self.built.adapter.output_names


# ------------------------------------------------------------------------------------------- what is verified, how
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


VERIFY_KEYS = {"float16": "fp16", "int8": "int8"}  # a reduced precision → the prefix of its verify.* tolerances


def float32_tolerances(cfg: D2ExportConfig) -> comparison.Float32:
    """What a float32 graph of this config is held to (`verify.atol`, `rtol`, `pixel_atol`, `max_mismatch`)."""
    v = cfg.verify
    return comparison.Float32(v.atol, v.rtol, v.pixel_atol, v.max_mismatch)


def reduced_tolerances(cfg: D2ExportConfig, precision: str = "float16") -> comparison.Reduced:
    """What a float16 or int8 graph of this config is held to (`verify.fp16_*` or `verify.int8_*`,
    `verify.confident`, top-K)."""
    v, key = cfg.verify, VERIFY_KEYS[precision]
    tol = [getattr(v, f"{key}_{name}") for name in ("atol", "rtol", "pixel_atol", "pixel_rtol", "max_mismatch")]
    return comparison.Reduced(precision, *tol, v.confident, v.top_k, v.min_top_k_agreement)


def _reduced_settings(cfg: D2ExportConfig, precision: str) -> str:
    """The config keys behind a reduced precision's tolerances, for a refusal's message."""
    v, key = cfg.verify, VERIFY_KEYS[precision]
    return ", ".join(f"comparison.{key}_{n}={getattr(v, f'{key}_{n}')}" for n in ("atol", "rtol", "pixel_atol",
                                                                               "pixel_rtol"))


# ---------------------------------------------------------------------------------------------------------- float32
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
        summary["ladder"] = _ladder_summary(built)
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


# What a model's own code raises when a picture is too small for it (an assert on a level's size, torch's "selected
# index k out of range" from a top-k over too few tokens, a shape mismatch): the kinds, and where they come from.
SIZE_ERRORS = (AssertionError, RuntimeError, ValueError, IndexError)
_NOT_THE_MODEL = (Path(__file__).resolve().parents[1],  # d2export itself
                  *(Path(torch.__file__).resolve().parent / p for p in ("_dynamo", "fx", "export", "_export", "jit",
                                                                        "onnx", "_subclasses")))  # torch's tracers


def _innermost(e: BaseException) -> str:
    """file:line of the innermost Python frame the exception passed through ('?' without a traceback)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def model_size_error(e: BaseException) -> bool:
    """Whether an exception from the eager reference is the model's own refusal of a size: one of SIZE_ERRORS (a
    NotImplementedError is no size limit), raised where the innermost Python frame is the model's code or a library
    it calls (an op raising in C++ counts at its Python caller), not d2export's nor torch's tracing machinery."""
    frames = traceback.extract_tb(e.__traceback__)
    if not isinstance(e, SIZE_ERRORS) or isinstance(e, NotImplementedError) or not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    return not any(where.is_relative_to(p) for p in _NOT_THE_MODEL)


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
        below = Subject(built, subject.path, cases)
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


# ------------------------------------------------------------------------------------------------ reduced precision
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
    """The verified float32 graph → int8 in place (exporting/int8.py), verified with int8's own tolerances."""
    from d2export.cpu import cpu_features
    from d2export.exporting import int8

    built, path, e = subject.built, subject.path, subject.built.cfg.export
    pictures = None
    if e.int8 == "static":
        files = picture_files(e.calibration, e.calibration_count)
        pictures = int8.Pictures(files, _picture_feeds(built, path))
    how = (f"calibrating on {len(pictures)} pictures ({e.calibration_method})" if pictures
           else "weights int8, activations quantised per run")
    progress.step(5, f"quantising to int8 ({e.int8})", how)
    quantized = path.with_name(f".{path.name}.int8")
    try:
        with progress.busy("quantising"):
            record = int8.quantize(path, quantized, e.int8, built.family.int8_float_scopes, cpu_features(),
                                   pictures, e.calibration_method, built.family.int8_static_ops)
        quantized.replace(path)
    finally:
        quantized.unlink(missing_ok=True)
    log.info("int8: %d node(s) quantised, %d kept float (%s); %s", record.quantized, len(record.kept_float),
             ", ".join(built.family.int8_float_scopes) or "none", record.why_reduce_range)
    summary = _verify_reduced(subject, "int8") if subject.cases else {"passed": None}
    return summary | {"quantization": record.to_dict()}


def _picture_feeds(built, path: Path):
    """A picture (HWC RGB uint8) → the graph's inputs, as the runtime predictor makes them."""
    import onnx

    from d2export.runtime.predictor import Processing

    e = built.cfg.export
    graph = onnx.load(str(path), load_external_data=False).graph
    preprocess = built.family.preprocess(built.d2cfg)
    if getattr(built, "size_divisibility", 0):  # the model runs only at its multiples: padded as when served
        preprocess["size_divisibility"] = built.size_divisibility
    processing = Processing(Manifest(model_file=path.name, family=built.family.name, inputs=graph_specs(graph.input),
                                     outputs=graph_specs(graph.output), opset=e.opset or 0, exporter=e.exporter,
                                     preprocess=preprocess))
    return lambda picture: processing.feeds([processing.prepare(picture, "RGB")])


def _verify_reduced(subject: Subject, precision: str) -> dict:
    """The reduced-precision graph's verification summary against eager float32: each output by its kind, the top-K
    detections the same, near-tied selections pinned where float noise explains them; or VerificationError."""
    cfg, path, cases, names = subject.built.cfg, subject.path, subject.cases, subject.output_names
    tol, kinds = reduced_tolerances(cfg, precision), subject.built.family.output_kinds
    session = check_sessions.session(path, cfg.verify.providers, precision)
    copy = check_sessions.selecting_copy(path)  # opened only if a case fails
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


# ------------------------------------------------------------------------------------------------- the parity ladder
def ladder(built, sizes: Sequence[Sequence[int]] | None = None):
    """The parity ladder (docs/ladder.md) for a prepared model (the pipeline's Built): its export settings and
    scope, the export's dummy input first, then one image per size (the verification sizes by default). Call it with
    no export scope open: it opens its own around a throwaway export."""
    cfg, tol = built.cfg, float32_tolerances(built.cfg)
    sizes = [tuple(s) for s in (sizes or verification_sizes(cfg, getattr(built, "size_divisibility", 0)))]
    cases = {f"{h}x{w}": dummy_images([(h, w)], seed=2000 + 10 * i) for i, (h, w) in enumerate(sizes)}
    return run_ladder(built.adapter, cfg.export, lambda: export_scope(built),
                      dummy_images(traced_sizes(cfg, built.adapter.batchable), cfg.model.seed), cases,
                      atol=max(tol.atol, tol.pixel_atol),  # inner tensors have no kind: the loosest
                      rtol=tol.rtol, max_mismatch=tol.max_mismatch, providers=cfg.verify.providers,
                      output_tolerances=tol.per_output(built.adapter.output_names, built.family.output_kinds))


def _ladder_summary(built) -> dict:
    """The parity ladder run and logged: its report, as the manifest keeps it. A diagnosis: where it crashes, that is
    an error in the report (logged as one, `error` in the summary, a line in a refusal), and the verification's own
    verdict stands beside it (the crash must not stand in for a refusal's figures, nor read as a clean ladder)."""
    try:
        with progress.busy("parity ladder"):
            report = ladder(built)
    except Exception as e:  # noqa: BLE001
        log.error("parity ladder: crashed, no module compared (%s: %s)", type(e).__name__, e)
        return {"diverged": None, "culprit": None, "cases": [], "error": f"{type(e).__name__}: {e}"}
    log.log(logging.WARNING if report.culprit() else logging.INFO, "parity ladder:\n%s", report.format())
    return report.to_dict()
