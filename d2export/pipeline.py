"""The flow, in one direction: config → user code → model → patches → wrapper → export → lint → verify → manifest.

Nothing lands at the destination unless every step passed: the graph and its manifest are staged beside it; the
model is renamed into place first and its manifest last, so a manifest (the runtime's way in) always has its model
and, by its sha256, names that very file. One export at a time writes a destination (a lock file beside it); each
export starts by removing what a killed one left there (staged files, a model without its manifest).
`D2EXPORT_FAULT_AT=<stage>` kills the export at that stage (SIGKILL), for the crash tests: see `FAULT_STAGES`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import platform
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from d2export import __version__, building, progress
from d2export.config import D2ExportConfig, check_files
from d2export.exporting import ladder as ladder_mod
from d2export.exporting import lint as lint_mod
from d2export.exporting import pinning, reduced, sessions
from d2export.exporting import verify as verify_mod
from d2export.exporting.onnx_export import export_onnx
from d2export.manifest import Manifest, embed_manifest, graph_specs, manifest_path, sha256_file, staged
from d2export.runtime import custom_ops
from d2export.stages import stage
from d2export.tracing import dummy_images, graph_inputs, torch_inputs

log = logging.getLogger("d2export")


@dataclass
class Built:
    """A model ready to export: what `prepare` returns, and what the ladder and benchmarks reuse."""

    cfg: D2ExportConfig
    d2cfg: object
    model: torch.nn.Module
    family: "families.Family"
    adapter: torch.nn.Module
    swapped: list[str]
    weights: dict  # the manifest's record of the weights (building.load_weights)
    device: str = "cpu"  # where the model runs (export.device resolved)


def prepare(cfg: D2ExportConfig, root: Path | None = None) -> Built:
    from d2export import families
    from d2export.patching import msda_swap

    root = Path(root or os.getcwd())
    check_files(cfg, root)
    _step(1, "importing user code", ", ".join(cfg.model.imports) or "-")
    with stage("import"):
        building.import_user_code(cfg.model, cfg.plugin, root)
    device = building.resolve_device(cfg.export.device)
    _step(2, "building the model", f"{cfg.model.lazy_config or cfg.model.d2_config} on {device}")
    with stage("build"):
        d2cfg = building.load_config(cfg.model, root, device)
        model, weights = building.build_model(cfg.model, d2cfg, root, device)
    swapped = msda_swap.swap(model) if cfg.plugin.swap_msda else []
    log.info("MSDA modules swapped for the traceable core: %d", len(swapped))
    try:
        family = families.recognise(model, cfg.model.family)
    except families.FamilyError as e:
        raise building.UserError(f"model.family={cfg.model.family}: {e}") from None
    log.info("model family: %s (%s)", family.name, family.summary)
    example = dummy_images(cfg.export.dummy_sizes, cfg.model.seed)
    with stage("build"):
        weights = building.condition_seeded(model, weights, family.seeded_scales,
                                            example[0] if family.seeded_norms else None)
        options = families.AdapterOptions(example=example, text_logits=cfg.export.text_logits)
        adapter = family.adapter(model, d2cfg, options).to(device).eval()
    return Built(cfg, d2cfg, model, family, adapter, swapped, weights, device)


def traced_sizes(cfg: D2ExportConfig) -> list[tuple[int, int]]:
    """The dummy batch the graph is traced on. torch.export specialises a dimension of size 1 to a constant, so a
    single dummy image gets a twin there (a dynamic batch must be traced at 2 or more)."""
    sizes = [tuple(s) for s in cfg.export.dummy_sizes]
    if cfg.export.exporter == "dynamo" and cfg.export.dynamic and len(sizes) == 1:
        sizes = sizes * 2
    return sizes


def verification_sizes(cfg: D2ExportConfig) -> list[tuple[int, int]]:
    """The dummy size, its transpose, a non-square size and its transpose (same token count, other aspect ratio —
    where a baked shape goes silently wrong), and an odd size; or what the config lists."""
    if cfg.verify.sizes:
        return [tuple(s) for s in cfg.verify.sizes]
    h, w = cfg.export.dummy_sizes[0]
    r = lambda v: max(64, int(round(v / 16)) * 16)  # noqa: E731
    c = (r(h * 0.8), r(w * 1.25))
    candidates = [(h, w), (w, h), c, (c[1], c[0]), (h + 13, w - 7)]
    return list(dict.fromkeys(candidates))


def verification_cases(built: Built) -> list[verify_mod.Case]:
    sizes = verification_sizes(built.cfg)
    groups: list[list[tuple[int, int]]] = [[s] for s in sizes]
    if built.cfg.verify.batch and built.adapter.batchable:
        groups.append([sizes[0], sizes[2 if len(sizes) > 2 else -1]])
    elif built.cfg.verify.batch:
        log.warning("verify.batch: no batch case, the %s graph takes one image per run (fixed batch axis)",
                    built.family.name)
    cases = []
    for i, group in progress.steps(list(enumerate(groups)), "eager references"):
        images = dummy_images(group, seed=1000 + 10 * i)
        name = ("batch " if len(group) > 1 else "") + "+".join(f"{h}x{w}" for h, w in group)
        cases.append(verify_mod.Case(name, graph_inputs(built.adapter, images), built.adapter.reference(images),
                                     images))
    return cases


@contextlib.contextmanager
def export_scope(built: Built) -> Iterator:
    """Everything that must hold while tracing: the configured MSDA sampler and the patches the target needs.
    Yields the patch report. The ladder and the benchmarks export through this too."""
    from d2export.ops.msda import use_sampler
    from d2export.patching import Target, apply_patches

    e = built.cfg.export
    with use_sampler(e.sampler), apply_patches(model=built.model, target=Target(e.opset, e.target)) as report:
        yield report


FAULT_STAGES = ("built", "exported", "verified", "staged", "model-published", "done")


def _fault_point(stage: str) -> None:
    if os.environ.get("D2EXPORT_FAULT_AT") == stage:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def destination_lock(final: Path) -> Iterator[None]:
    """Holds `.<name>.lock` beside `final` for the block, refusing (one line) while another export holds it; the
    kernel lets go of it when the holder dies, however it dies."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            raise building.UserError(f"another export (pid {holder}) is writing {final}: wait for it, or choose "
                                     "another export.output_dir/export.filename") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def remove_orphans(final: Path) -> list[Path]:
    """What a killed export of `final` left (under the lock, so no live export owns them): staged files, and a
    model whose manifest is missing or names another file. Returns what was removed."""
    manifest = manifest_path(final)
    orphans = [*final.parent.glob(f".{final.stem}.*.staged.onnx"), *final.parent.glob(f".{manifest.stem}.*.tmp")]
    if final.exists():
        try:
            paired = Manifest.read(manifest).sha256 == sha256_file(final)
        except (OSError, ValueError, TypeError, KeyError):
            paired = False
        if not paired:
            orphans += [final, manifest]
    for path in orphans:
        path.unlink(missing_ok=True)
    if orphans:
        log.warning("removed what an interrupted export left: %s", ", ".join(p.name for p in orphans))
    return orphans


def export(cfg: D2ExportConfig, root: Path | None = None, built: Built | None = None) -> Manifest:
    """The whole flow; `built` reuses a prepared model (its config must be `cfg`)."""
    final = Path(cfg.export.output_dir) / cfg.export.filename
    with destination_lock(final):
        remove_orphans(final)
        return _export(cfg, root, final, built)


def _export(cfg: D2ExportConfig, root: Path | None, final: Path, built: Built | None) -> Manifest:
    started = time.perf_counter()
    built = built or prepare(cfg, root)
    with building.exact_float32():  # eager references and the trace in float32, as onnxruntime computes
        return _export_built(cfg, final, built, started)


def _export_built(cfg: D2ExportConfig, final: Path, built: Built, started: float) -> Manifest:
    _fault_point("built")
    adapter, e = built.adapter, cfg.export
    cases = []
    if cfg.verify.enabled:
        _step(3, "eager reference outputs", ", ".join(c for c in map(str, verification_sizes(cfg))))
        with stage("verify"):
            cases = verification_cases(built)  # eager, before any export-time patch: the independent side
    args = torch_inputs(adapter, dummy_images(traced_sizes(cfg), cfg.model.seed))
    axes = adapter.dynamic_axes if e.dynamic else None
    with contextlib.ExitStack() as publish:  # the manifest is staged outside the model: renamed after it
        staged_manifest = publish.enter_context(staged(manifest_path(final)))
        with staged(final, suffix=".staged.onnx") as staged_model:
            with export_scope(built) as report:
                _step(4, "exporting", f"{e.exporter} exporter, opset {e.opset}, sampler {e.sampler}")
                with progress.busy(f"exporting ({e.exporter})"), stage("export"):
                    result = export_onnx(adapter, args, staged_model, input_names=adapter.input_names,
                                         output_names=adapter.output_names, dynamic_axes=axes, opset=e.opset,
                                         exporter=e.exporter, simplify=e.simplify)
                log.info("exported %d nodes in %.1f s", result.node_count, result.seconds)
                _fault_point("exported")
                lint = _lint(built, staged_model, result, axes) if e.lint else None
            log.info("patches applied:\n%s", report)
            if lint is not None:
                log.log(logging.INFO if lint.clean else logging.WARNING, "%s", lint.format())
            with stage("verify"):
                verification = (_verify(cfg, staged_model, adapter.output_names, cases, built) if cases
                                else {"passed": None}) | {"device": built.device}  # where the references ran
                if e.fp16:
                    verification["fp16"] = _to_fp16(cfg, staged_model, adapter.output_names, cases, built)
                if e.int8:
                    verification["int8"] = _to_int8(cfg, staged_model, adapter.output_names, cases, built)
            _fault_point("verified")
            manifest = _manifest(built, staged_model, final.name, report, lint, verification, started)
            manifest.write(staged_manifest)
            _fault_point("staged")
        # the model is in place; its manifest follows (a failure or kill in between leaves an orphan the next removes)
        _fault_point("model-published")
    _fault_point("done")
    _step(6, "done", f"{final} ({final.stat().st_size / 1e6:.1f} MB), manifest {manifest_path(final).name}")
    return manifest


def _manifest(built: Built, model: Path, name: str, report, lint, verification: dict, started: float) -> Manifest:
    import onnx

    e = built.cfg.export
    onnx_model = onnx.load(str(model), load_external_data=False)
    graph = onnx_model.graph
    opset = next(o.version for o in onnx_model.opset_import if o.domain in ("", "ai.onnx"))
    if opset != e.opset:  # torch.export has no translations below 18 and keeps 18 when conversion fails
        log.warning("asked for opset %d, the exporter wrote opset %d", e.opset, opset)
    manifest = Manifest(
        model_file=name, family=built.family.name,
        inputs=_documented(graph_specs(graph.input), built.family.input_docs),
        outputs=_documented(graph_specs(graph.output), built.family.output_docs),
        opset=opset, exporter=e.exporter, sampler=e.sampler, custom_ops=custom_ops.graph_ops(onnx_model),
        precision="int8" if e.int8 else "float16" if e.fp16 else "float32",
        preprocess=built.family.preprocess(built.d2cfg), postprocess=built.family.postprocess(built.d2cfg),
        versions=_versions(), patches=[p for p in report.to_dict()["patches"] if p["status"] != "not-needed"],
        verification=verification | ({"lint": lint.to_dict()} if lint else {}),
        export_seconds=round(time.perf_counter() - started, 2), weights=built.weights,
    )
    embed_manifest(model, manifest)  # the essentials also inside the model, before its hash is taken
    return dataclasses.replace(manifest, sha256=sha256_file(model))


def _documented(specs: list, docs: dict[str, str]) -> list:
    return [dataclasses.replace(s, doc=s.doc or docs.get(s.name, "")) for s in specs]


def _step(i: int, what: str, detail: str = "") -> None:
    log.info("[%d/6] %s%s", i, what, f": {detail}" if detail else "")


def _lint(built: Built, staged: Path, result, axes) -> lint_mod.LintReport:
    import onnx

    report = lint_mod.LintReport(tracer_warnings=lint_mod.summarise_warnings(result.tracer_warnings))
    if axes is None:
        return report  # a static export is size-specific by request
    sizes = traced_sizes(built.cfg)
    h, w = sizes[0]
    second = [(h + 32, max(64, w - 32))] + [tuple(s) for s in sizes[1:]]
    with tempfile.TemporaryDirectory() as tmp, progress.busy("lint: tracing at a second size"):
        e = built.cfg.export
        export_onnx(built.adapter, torch_inputs(built.adapter, dummy_images(second, 7)), Path(tmp) / "second.onnx",
                    input_names=built.adapter.input_names, output_names=built.adapter.output_names,
                    dynamic_axes=axes, opset=e.opset, exporter=e.exporter)
        report.identical, report.size_dependent_constants = lint_mod.compare_graphs(
            onnx.load(str(staged)), onnx.load(str(Path(tmp) / "second.onnx")))
    return report


def _verify(cfg: D2ExportConfig, path: Path, output_names, cases, built: Built) -> dict:
    _step(5, "verifying with onnxruntime", f"{len(cases)} cases")
    session = sessions.session(path, cfg.verify.providers)
    v = cfg.verify
    per_output = _output_tolerances(built)
    results = verify_mod.run_cases(session, output_names, cases, v.atol, v.rtol, v.max_mismatch, built.family.sorted_by,
                                   per_output)
    judge = lambda case, expected, actual: _all_ok(verify_mod.compare_case(  # noqa: E731
        case, expected, actual, v.atol, v.rtol, v.max_mismatch, built.family.sorted_by, per_output))
    pinned = _pin_selections(cfg, path, output_names, cases, {r.case for r in results if not r.ok}, built, judge,
                             pinning.Tolerances(v.atol, v.rtol, v.pixel_atol))
    results = pinning.with_pinned(results, pinned)
    log.info("verification:\n%s", verify_mod.format_table(results))
    summary = verify_mod.summarise(results) | {
        "atol": v.atol, "rtol": v.rtol, "pixel_atol": v.pixel_atol,
        "tolerances": {kind: {"atol": a, "rtol": r} for kind, (a, r) in _tolerances_by_kind(cfg).items()},
        "output_kinds": {n: verify_mod.output_kind(n, built.family.output_kinds) for n in output_names}
    } | sessions.ran_on(session, path)
    if pinned:
        summary["pinned"] = [p.to_dict() for p in pinned]
    if v.ladder or not summary["passed"]:
        summary["ladder"] = _ladder(built)
    try:
        verify_mod.check(results)
    except verify_mod.VerificationError as e:
        culprit = summary["ladder"]["culprit"]
        where = "" if culprit is None else (f"\nthe parity ladder's first diverging module: "
                                            f"{culprit['module'] or ladder_mod.ROOT} at "
                                            f"{culprit['case']}, forward at {culprit['source']}")
        raise verify_mod.VerificationError(f"{e}{where}{pinning.unpinned_lines(summary)}"
                                           f"{sessions.near_ties_lines(path, cases, results, 'float32')}") from None
    return summary


def _tolerances_by_kind(cfg: D2ExportConfig) -> dict[str, tuple[float, float]]:
    return verify_mod.tolerances_by_kind(cfg.verify.atol, cfg.verify.rtol, cfg.verify.pixel_atol)


def _output_tolerances(built: Built) -> dict[str, tuple[float, float]]:
    """Each graph output's (atol, rtol) by the kind its family says it holds."""
    return verify_mod.output_tolerances(built.adapter.output_names, built.family.output_kinds,
                                        _tolerances_by_kind(built.cfg))


def _all_ok(comparisons: list) -> tuple[list, bool]:
    return comparisons, all(c.ok for c in comparisons)


def _pin_selections(cfg: D2ExportConfig, path: Path, output_names, cases, failed_names: set, built: Built, judge,
                    tolerances) -> list:
    """The failed cases again with the graph's near-tied selections imposed on eager (exporting/pinning.py), its
    candidate values held to `tolerances` (those of the outputs)."""
    failed = [c for c in cases if c.images is not None and c.name in failed_names]
    if not failed or not cfg.verify.pin_selections:
        return []
    with progress.busy("checking the failed cases' selections"):
        pinned = pinning.pin_cases(path, failed, output_names, lambda c: built.adapter.reference(c.images), judge,
                                   tolerances, sessions.session_options(path))
    for p in pinned:
        log.log(logging.INFO if p.ok else logging.WARNING, "%s", p.line())
    return pinned


VERIFY_KEYS = {"float16": "fp16", "int8": "int8"}  # a reduced precision → the prefix of its verify.* tolerances


def reduced_tolerances(cfg: D2ExportConfig, precision: str = "float16") -> verify_mod.Reduced:
    """What a float16 or int8 graph of this config is held to (`verify.fp16_*` or `verify.int8_*`,
    `verify.confident`, top-K)."""
    v, key = cfg.verify, VERIFY_KEYS[precision]
    tol = [getattr(v, f"{key}_{name}") for name in ("atol", "rtol", "pixel_atol", "pixel_rtol", "max_mismatch")]
    return verify_mod.Reduced(precision, *tol, v.confident, v.top_k, v.min_top_k_agreement)


def _settings(cfg: D2ExportConfig, key: str) -> str:
    v = cfg.verify
    return ", ".join(f"verify.{key}_{n}={getattr(v, f'{key}_{n}')}" for n in ("atol", "rtol", "pixel_atol",
                                                                               "pixel_rtol"))


def _to_fp16(cfg: D2ExportConfig, path: Path, output_names, cases, built: Built) -> dict:
    """The verified float32 graph → float16 in place, verified on the same cases with float16's own tolerances."""
    import onnx

    from d2export.exporting.fp16 import to_float16

    _step(5, "converting to float16", f"keep_io_types={cfg.export.keep_io_types}")
    onnx.save(to_float16(onnx.load(str(path)), keep_io_types=cfg.export.keep_io_types), str(path))
    if not cases:
        return {"passed": None}
    return _verify_reduced(cfg, path, output_names, cases, built, "float16")


def _to_int8(cfg: D2ExportConfig, path: Path, output_names, cases, built: Built) -> dict:
    """The verified float32 graph → int8 in place (exporting/int8.py), verified with int8's own tolerances."""
    from d2export.cpu import cpu_features
    from d2export.exporting import int8

    e = cfg.export
    pictures = None
    if e.int8 == "static":
        files = int8.calibration_files(e.calibration, e.calibration_count)
        pictures = int8.Pictures(files, _picture_feeds(built, path))
    _step(5, f"quantising to int8 ({e.int8})", f"calibrating on {len(pictures)} pictures ({e.calibration_method})"
          if pictures else "weights int8, activations quantised per run")
    quantized = path.with_name(f".{path.name}.int8")
    try:
        with progress.busy("quantising"):
            record = int8.quantize(path, quantized, e.int8, built.family.int8_scopes(e.int8), cpu_features(),
                                   pictures, e.calibration_method, built.family.int8_static_ops)
        quantized.replace(path)
    finally:
        quantized.unlink(missing_ok=True)
    log.info("int8: %d node(s) quantised, %d kept float (%s); %s", record.quantized, len(record.kept_float),
             ", ".join(built.family.int8_scopes(e.int8)) or "none", record.why_reduce_range)
    summary = {"passed": None} if not cases else _verify_reduced(cfg, path, output_names, cases, built, "int8")
    return summary | {"quantization": record.to_dict()}


def _picture_feeds(built: Built, path: Path):
    """A picture (HWC RGB uint8) → the graph's inputs, as the runtime predictor makes them."""
    import onnx

    from d2export.runtime.predictor import Processing

    e = built.cfg.export
    graph = onnx.load(str(path), load_external_data=False).graph
    processing = Processing(Manifest(model_file=path.name, family=built.family.name, inputs=graph_specs(graph.input),
                                     outputs=graph_specs(graph.output), opset=e.opset or 0, exporter=e.exporter,
                                     preprocess=built.family.preprocess(built.d2cfg)))
    return lambda picture: processing.feeds([processing.prepare(picture, "RGB")])


def _verify_reduced(cfg: D2ExportConfig, path: Path, output_names, cases, built: Built, precision: str) -> dict:
    pin = lambda failed, judge, tolerances: _pin_selections(  # noqa: E731
        cfg, path, output_names, cases, failed, built, judge, tolerances)
    return reduced.verify(path, output_names, cases, reduced_tolerances(cfg, precision), built.family.output_kinds,
                          cfg.verify.providers, pin, _settings(cfg, VERIFY_KEYS[precision]))


def ladder(built: Built, sizes: Sequence[Sequence[int]] | None = None):
    """The parity ladder (docs/ladder.md) for a prepared model: its export settings and scope, the export's dummy
    input first, then one image per size (the verification sizes by default). Call it with no export scope open:
    it opens its own around a throwaway export."""
    from d2export.exporting.ladder import run_ladder

    cfg = built.cfg
    sizes = [tuple(s) for s in (sizes or verification_sizes(cfg))]
    cases = {f"{h}x{w}": dummy_images([(h, w)], seed=2000 + 10 * i) for i, (h, w) in enumerate(sizes)}
    return run_ladder(built.adapter, cfg.export, lambda: export_scope(built),
                      dummy_images(traced_sizes(cfg), cfg.model.seed), cases,
                      atol=max(cfg.verify.atol, cfg.verify.pixel_atol),  # inner tensors have no kind: the loosest
                      rtol=cfg.verify.rtol, max_mismatch=cfg.verify.max_mismatch, providers=cfg.verify.providers,
                      output_tolerances=_output_tolerances(built))


def _ladder(built: Built) -> dict:
    with progress.busy("parity ladder"):
        report = ladder(built)
    log.log(logging.WARNING if report.culprit() else logging.INFO, "parity ladder:\n%s", report.format())
    return report.to_dict()


def _versions() -> dict:
    import onnx

    versions = {"d2export": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
                "python": platform.python_version()}
    for name in ("onnxruntime", "detectron2"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a version is information, never a reason to fail
            versions[name] = "unavailable"
    return versions
