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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from d2export import __version__, building, progress
from d2export.building import charset_search
from d2export.charset import CharsetError
from d2export.config import D2ExportConfig, check_files
from d2export.verification import bfloat16, served_text, float32, reduced_precision
from d2export.exporting.lint import lint_export
from d2export.exporting.onnx_export import ExportError, export_onnx, export_scope, routes, traced_sizes
# ladder and reduced_tolerances live in verification/; d2export.pipeline keeps them for its callers (docs/ladder.md)
from d2export.verification.cases import verification_cases, verification_sizes
from d2export.verification.ladder import ladder  # noqa: F401
from d2export.verification.subject import Subject, served_manifest
from d2export.verification.tolerances import reduced_tolerances  # noqa: F401
from d2export.manifest import Manifest, embed_manifest, manifest_path, sha256_file, staged
from d2export.stage_errors import stage
from d2export.tracing import dummy_images, torch_inputs

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
    charset: dict = field(default_factory=dict)  # the manifest's character set, where the family reads text
    model_folders: list = field(default_factory=list)  # where the model's relative files may lie (charset_search)
    # where the model's own code runs only at multiples of a size (cases.verification_cases finds it): that
    # multiple (0: any size), and which verification sizes were chosen and why
    size_divisibility: int = 0
    size_choice: dict = field(default_factory=dict)


def prepare(cfg: D2ExportConfig, root: Path | None = None) -> Built:
    from d2export import families
    from d2export.patching import msda_swap

    root = Path(root or os.getcwd())
    check_files(cfg, root)
    progress.step(1, "importing user code", ", ".join(cfg.model.imports) or "-")
    with stage("import"):
        building.import_user_code(cfg.model, cfg.plugin, root)
    device = building.resolve_device(cfg.export.device)
    progress.step(2, "building the model", f"{cfg.model.lazy_config or cfg.model.d2_config} on {device}")
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
    try:  # before anything is traced: a wrong dictionary is said now, not served as wrong words
        folders = charset_search(cfg.model, root)
        charset = family.text_charset(d2cfg, cfg.model.charset, folders, model)
    except CharsetError as e:
        raise building.UserError(f"the model's character set: {e}") from None
    if cfg.export.postprocess == "graph" and not family.postprocess_in_graph:
        raise building.UserError(f"export.postprocess=graph: the {family.name} family has no post-processing to put "
                                 "in the graph (segmenters only: Mask2Former, OneFormer, MaskDINO)")
    example = dummy_images(cfg.export.dummy_sizes, cfg.model.seed)
    with stage("build"):
        weights = building.condition_seeded(model, weights, family.seeded_scales,
                                            example[0] if family.seeded_norms else None)
        options = families.AdapterOptions(example=example, text_logits=cfg.export.text_logits,
                                          postprocess=cfg.export.postprocess)
        adapter = family.adapter(model, d2cfg, options).to(device).eval()
    return Built(cfg, d2cfg, model, family, adapter, swapped, weights, device, charset, folders)


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
    """The whole flow; `built` reuses a prepared model (prepared from this very config). The config is read, never
    written: the route `export.exporter=auto` chooses is the manifest's `exporter`."""
    if built is not None and built.cfg != cfg:
        raise ValueError("pipeline.export(cfg, built=...): `built` was prepared from another config; pass built.cfg, "
                         "or dataclasses.replace(built, cfg=cfg) where only export settings differ")
    final = Path(cfg.export.output_dir) / cfg.export.filename
    with destination_lock(final):
        remove_orphans(final)
        return _export(cfg, root, final, built)


def _export(cfg: D2ExportConfig, root: Path | None, final: Path, built: Built | None) -> Manifest:
    started = time.perf_counter()
    built = built or prepare(cfg, root)
    with building.exact_float32():  # eager references and the trace in float32, as onnxruntime computes
        return _export_built(final, built, started)


def _export_built(final: Path, built: Built, started: float) -> Manifest:
    _fault_point("built")
    adapter, cfg, e = built.adapter, built.cfg, built.cfg.export
    cases = []
    if cfg.verify.enabled:
        progress.step(3, "eager reference outputs", ", ".join(c for c in map(str, verification_sizes(cfg))))
        with stage("verify"):
            cases = verification_cases(built)  # eager, before any export-time patch: the independent side
    axes = adapter.dynamic_axes if e.dynamic else None
    with contextlib.ExitStack() as publish:  # the manifest is staged outside the model: renamed after it
        staged_manifest = publish.enter_context(staged(manifest_path(final)))
        with staged(final, suffix=".staged.onnx") as staged_model:
            with export_scope(built) as report:
                result = _export_by_route(built, staged_model, axes)
                log.info("exported %d nodes in %.1f s", result.node_count, result.seconds)
                _fault_point("exported")
                lint = _lint(built, staged_model, result, axes)
            log.info("patches applied:\n%s", report)
            if lint is not None:
                log.log(logging.INFO if lint.clean else logging.WARNING, "%s", lint.format())
            with stage("verify"):
                subject = Subject(built, staged_model, cases, result.exporter)
                verification = (float32.verify_float32(subject) if cases
                                else {"passed": None}) | {"device": built.device}  # where the references ran
                own = getattr(adapter, "own_inference", None)  # segmenters: served results vs own inference
                if own is not None and cases:
                    verification["own_inference"] = own
                if lint is not None and lint.min_sizes and cases:
                    lint.below_minimum = float32.check_below_minimums(subject, lint.min_sizes)
                if e.fp16:
                    verification["fp16"] = reduced_precision.convert_to_float16(subject)
                if e.int8:
                    verification["int8"] = reduced_precision.quantise_to_int8(subject)
                if e.bf16:  # the float32 graph as OpenVINO serves it in bfloat16
                    verification["bf16"] = bfloat16.verify_bfloat16(subject)
            _fault_point("verified")
            manifest = _manifest(built, staged_model, final.name, result.exporter, report, lint, verification, started)
            if cases:  # what users receive, against the model's own code (text spotters' words)
                with stage("verify"):
                    served = served_text.check(built, staged_model, manifest, _unpinned_pictures(cases, verification))
                if served:
                    manifest = dataclasses.replace(manifest,
                                                   verification=manifest.verification | {"served_text": served})
            manifest.write(staged_manifest)
            _fault_point("staged")
        # the model is in place; its manifest follows (a failure or kill in between leaves an orphan the next removes)
        _fault_point("model-published")
    _fault_point("done")
    progress.step(6, "done", f"{final} ({final.stat().st_size / 1e6:.1f} MB), manifest {manifest_path(final).name}")
    return manifest


def _unpinned_pictures(cases, verification: dict, count: int = 2) -> list:
    """The first `count` single-picture cases' pictures that verified without near-tied picks imposed."""
    pinned = {p["case"] for p in verification.get("pinned", [])}
    return [c.images[0] for c in cases if c.images and len(c.images) == 1 and c.name not in pinned][:count]


def _lint(built: Built, staged_model: Path, result, axes):
    """The lint (None where there is none). Through torch.export it is read off the capture at no cost and gives the
    minimums the verification checks below: it runs whatever `export.lint` says, else pictures under the minimums
    would be served unchecked; `export.lint=false` skips TorchScript's second trace only."""
    if built.cfg.export.lint or (axes is not None and result.size_assumptions is not None):
        return lint_export(built, staged_model, result, axes)
    return None


def _export_by_route(built: Built, staged_model: Path, axes):
    """The graph through export.exporter's route; `auto`: TorchScript's, then torch.export's where that fails (the
    route PyTorch keeps). The result names the route that wrote the graph: the lint, the ladder and the manifest read
    it there."""
    cfg, adapter = built.cfg, built.adapter
    e = cfg.export
    tried = routes(e.exporter)
    for i, route in enumerate(tried):
        args = torch_inputs(adapter, dummy_images(traced_sizes(cfg, adapter.batchable, route), cfg.model.seed))
        progress.step(4, "exporting", f"{route} exporter, opset {e.opset}, sampler {e.sampler}")
        try:
            with progress.busy(f"exporting ({route})"), stage("export"):
                return export_onnx(adapter, args, staged_model, input_names=adapter.input_names,
                                   output_names=adapter.output_names, dynamic_axes=axes, opset=e.opset,
                                   exporter=route, simplify=e.simplify)
        except ExportError as error:
            if i + 1 == len(tried):
                raise
            log.warning("export.exporter=auto: the %s exporter failed, trying %s next:\n%s", route, tried[i + 1],
                        error)


def _manifest(built: Built, model: Path, name: str, exporter: str, report, lint, verification: dict,
              started: float) -> Manifest:
    e = built.cfg.export
    served = served_manifest(built, model, exporter)
    if served.opset != e.opset:  # torch.export has no translations below 18 and keeps 18 when conversion fails
        log.warning("asked for opset %d, the exporter wrote opset %d", e.opset, served.opset)
    manifest = dataclasses.replace(
        served, model_file=name, preprocess=served.preprocess | _min_input_size(lint),
        versions=_versions(), patches=[p for p in report.to_dict()["patches"] if p["status"] != "not-needed"],
        verification=verification | ({"lint": lint.to_dict()} if lint else {})
        | ({"sizes_chosen": built.size_choice} if built.size_choice else {}),
        export_seconds=round(time.perf_counter() - started, 2), weights=built.weights,
    )
    embed_manifest(model, manifest)  # the essentials also inside the model, before its hash is taken
    return dataclasses.replace(manifest, sha256=sha256_file(model))


def _min_input_size(lint) -> dict:
    """The least [height, width] the graph is served at, where torch.export narrowed it and the graph answered
    differently below (the runtime pads smaller pictures up to it, as detectron2 pads a batch)."""
    least = lint.serve_from if lint is not None else {}
    return {"min_input_size": [least.get("height", 0), least.get("width", 0)]} if least else {}


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
