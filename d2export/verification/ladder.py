"""The parity ladder: the first module where onnxruntime and eager PyTorch part ways.

Forward hooks on the "rungs" (backbone stages, input projections, encoder/decoder layers, every MSDA, the heads,
the adapter's outputs) record every call's output tensors, keyed by (module path, call index, place in the output), so a
module called several times (a shared head) is compared call by call.

- Eager side: the adapter run *outside* the export scope, i.e. the model's own code. Everything the export adds
  (patches, the MSDA sampler, the tracer, the converter, onnxruntime) is then on the other side of the comparison,
  so a patch that is wrong in value is caught as surely as a shape the tracer baked in.
- ONNX side: a throwaway export, same settings and scope, whose extra outputs are the same hooked tensors, written
  to a temporary directory and deleted; the production file is never touched.

Rows are ordered by when the eager call finished (a child before its parent), so the first row past tolerance is
the innermost, earliest module that diverged. A graph onnxruntime cannot run at some size (a shape baked in that
breaks a broadcast) is reported with the module that owns the failing node.

`ladder` runs it for a prepared model (the pipeline's Built) at its verification sizes and float32 tolerances;
`_ladder_summary` runs and logs it as verification's diagnosis of a failure.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, ContextManager, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from d2export import progress
from d2export.verification import near_ties, pinning, check_sessions
from d2export.exporting.onnx_export import export_onnx, export_scope, routes, traced_sizes
from d2export.verification.cases import verification_sizes
from d2export.verification.comparison import difference
from d2export.verification.tolerances import float32_tolerances
from d2export.tracing import dummy_images, graph_inputs, torch_inputs

log = logging.getLogger("d2export")

Key = tuple  # (module path, call index, where the tensor sits in the call's output: "", "[1]", "['pred_logits']")
ROOT = "(outputs)"  # how the adapter itself is named in the table


# ------------------------------------------------------------------------------------------------------ the rungs
def default_rungs(root: nn.Module, depth: int = 3) -> list[str]:
    """Paths of the modules worth a row: those at most `depth` below `root`, every element of a ModuleList
    (encoder/decoder layers, input projections, per-layer heads), every child of a detectron2 backbone (its
    stages) and every MSDA. A shared module is listed once, under its first path in `named_modules()`."""
    from d2export.ops.msda_modules import is_msda

    canonical = {id(m): p for p, m in root.named_modules()}
    chosen: set[int] = set()
    for path, module in root.named_modules(remove_duplicate=False):  # a module qualifies by any of its paths
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue  # containers are never called
        parent = root.get_submodule(path.rpartition(".")[0]) if path else None
        if ((path.count(".") + 1 if path else 0) <= depth or isinstance(parent, nn.ModuleList)
                or _is_backbone(parent) or is_msda(module)):
            chosen.add(id(module))
    return [p for i, p in canonical.items() if i in chosen]


def _is_backbone(module: nn.Module | None) -> bool:
    """detectron2's Backbone (ResNet, FPN, …) by what it has: children are its stages."""
    return module is not None and callable(getattr(module, "output_shape", None)) and hasattr(
        type(module), "size_divisibility")


def flatten_tensors(value, where: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every tensor inside a module's output with its access path ("[0]['res3'].tensors"): tuples, lists, dicts,
    and objects such as NestedTensor, ImageList or Instances through their attributes. Paths, not positions, name
    the tensors because tracing may add some (detectron2's Instances keep their image size as a tensor then)."""
    if isinstance(value, torch.Tensor):
        return [(where, value)]
    if depth > 5 or value is None or isinstance(value, (str, bytes, int, float, bool, nn.Module)):
        return []
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    elif hasattr(value, "__dict__"):
        items = [(f".{k}", v) for k, v in vars(value).items()]
    else:
        return []
    return [found for part, v in items for found in flatten_tensors(v, where + part, depth + 1)]


def forward_source(module: nn.Module) -> str:
    """file:line of the forward that runs now: a patch's replacement inside the export scope, else the class's."""
    fn = module.forward
    for _ in range(10):  # peel bound methods, partials and functools.wraps layers
        inner = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
        inner = inner or (fn.func if isinstance(fn, functools.partial) else None)
        if inner is None:
            break
        fn = inner
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return "<unknown>"


class Recorder:
    """Forward hooks on `paths` of `root` while open: `records` maps (path, call, place) → a copy of the tensor, in
    the order calls finished; `sources` maps path → forward_source at its first call. Copies, because a caller may
    modify a module's output in place later (TESTR's `tmp += reference`); while tracing, the copy is a distinct
    graph value that can become an output of its own."""

    def __init__(self, root: nn.Module, paths: Sequence[str]):
        self.modules = [(p, root.get_submodule(p)) for p in paths]
        self.records: dict[Key, torch.Tensor] = {}
        self.sources: dict[str, str] = {}

    def __enter__(self) -> "Recorder":
        self.records, self.sources, self._calls = {}, {}, Counter()
        self._handles = [m.register_forward_hook(functools.partial(self._hook, p)) for p, m in self.modules]
        return self

    def _hook(self, path, module, args, output):
        call = self._calls[path]
        self._calls[path] += 1
        self.sources.setdefault(path, forward_source(module))
        for where, t in flatten_tensors(output):
            self.records[(path, call, where)] = t.detach().clone()

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


class _WithRungs(nn.Module):
    """The adapter, returning its outputs followed by the hooked tensors listed in `keys`."""

    def __init__(self, adapter: nn.Module, paths: Sequence[str], keys: Sequence[Key]):
        super().__init__()
        self.adapter, self.paths, self.keys = adapter, list(paths), list(keys)
        self.untraced: set[Key] = set()  # rungs torch.export's trace saw as Python values, not tensors
        # torch.export binds inputs (and dynamic shapes) by the forward's parameter names: take the adapter's
        def forward(*inputs):
            return self._forward(*inputs)

        forward.__signature__ = inspect.signature(adapter.forward)
        self.forward = forward

    def _forward(self, *inputs):
        with Recorder(self.adapter, self.paths) as rec:
            outputs = self.adapter(*inputs)
        missing = [k for k in self.keys if k not in rec.records]
        if missing and not torch.compiler.is_exporting():
            raise RuntimeError(f"the traced run did not call what the eager probe did: {missing[:3]}")
        # under torch.export a patch may hand on Python sizes where eager has a tensor (level-sizes-for-torch-export):
        # an empty stand-in keeps every output in its named place, and the rung is reported as having no tensor
        self.untraced.update(missing)
        outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        return outputs + tuple(rec.records[k] if k in rec.records else torch.zeros(0) for k in self.keys)


# ------------------------------------------------------------------------------------------------------ the report
@dataclass
class Row:
    module: str
    call: int
    part: str  # where in the module's output
    shape: list
    max_abs: float
    max_rel: float
    first_bad: list | None  # index of the first element past tolerance (C order)
    ok: bool  # compared, and within tolerance
    note: str = ""
    reached: bool = True  # False: the graph has no tensor for it, so nothing was compared (neither ok nor diverged)

    @property
    def label(self) -> str:
        return f"{self.module or ROOT}" + (f" #{self.call}" if self.call else "") + self.part


@dataclass
class CaseReport:
    name: str
    sizes: list = field(default_factory=list)  # (height, width) of each image
    rows: list[Row] = field(default_factory=list)
    error: str | None = None  # onnxruntime failed to run the graph
    error_module: str | None = None  # the module owning the failing node
    ties: list = field(default_factory=list)  # pinning.Pick: near-tied selections the graph made otherwise (imposed)

    @property
    def first(self) -> Row | None:
        return next((r for r in self.rows if r.reached and not r.ok), None)

    @property
    def not_reached(self) -> list[Row]:
        return [r for r in self.rows if not r.reached]

    @property
    def diverged(self) -> bool:
        return self.error is not None or self.first is not None


@dataclass
class Culprit:
    case: str
    module: str
    call: int
    failed: bool  # onnxruntime could not run the graph at this size; `module` owns the node it failed on
    source: str  # file:line of the forward traced (a patch's, if one replaced it)
    model_source: str  # file:line of the module's own forward, as eager ran it
    tracer_warnings: list[str]  # TracerWarnings recorded in those files during the export
    new_at_size: bool  # diverges at this size, not at the export input's: a shape baked into the graph
    new_on_image: bool = False  # diverges on another image of the export input's size: values, not shapes

    def __str__(self) -> str:
        what = "onnxruntime failed" if self.failed else "first divergence"
        lines = [f"{what} at {self.case}: {self.module or ROOT}" + (f" (call #{self.call})" if self.call else ""),
                 f"  forward: {self.source}" + ("" if self.source == self.model_source
                                                 else f" (patched; the model's own: {self.model_source})")]
        if self.new_at_size:
            lines.append("  clean at the export input, wrong at this size: a shape from the export is baked in here")
        elif self.new_on_image:
            lines.append("  clean at the export input, wrong on another image of the same size: a difference that "
                         "depends on values, not shapes (a near-tied selection or threshold, a value baked in)")
        lines += [f"  TracerWarning {w}" for w in self.tracer_warnings]
        return "\n".join(lines)


@dataclass
class LadderReport:
    cases: list[CaseReport]
    traced_sources: dict[str, str]
    model_sources: dict[str, str]
    tracer_warnings: list[str]  # "file:line: message", as recorded while the ladder's graph was exported
    nodes: int = 0
    atol: float = 0.0
    rtol: float = 0.0

    def culprits(self) -> list[Culprit]:
        """Per diverging case, the first module past tolerance (or owning the node onnxruntime failed on)."""
        export_clean = bool(self.cases) and not self.cases[0].diverged
        found = []
        for i, case in enumerate(self.cases):
            if case.first is not None:
                module, call = case.first.module, case.first.call
            elif case.error is not None:
                module, call = case.error_module or "", 0
            else:
                continue
            src = self.traced_sources.get(module, "<unknown>")
            own = self.model_sources.get(module, src)
            files = {s.rsplit(":", 1)[0] for s in (src, own)}
            warns = [w for w in self.tracer_warnings if w.split(":", 1)[0] in files]
            new = export_clean and i > 0
            same_size = case.sizes == self.cases[0].sizes
            found.append(Culprit(case.name, module, call, case.first is None, src, own, warns, new and not same_size,
                                 new and same_size))
        return found

    def culprit(self) -> Culprit | None:
        found = self.culprits()
        return found[0] if found else None

    def format(self, all_rows: bool = False) -> str:
        """A table per case: every row with all_rows, else up to the first divergence and three more."""
        out = []
        for case in self.cases:
            missed = f", {len(case.not_reached)} rung(s) not reached" if case.not_reached else ""
            out.append(f"== {case.name}: " + ("DIVERGES" if case.diverged else "clean") + missed
                       + f" (atol {self.atol:g}, rtol {self.rtol:g})")
            if case.error:
                out.append(f"onnxruntime failed in {case.error_module or '?'}: {case.error}")
            out += [f"the graph's near-tied pick imposed on eager: {_tie(p)}" for p in case.ties]
            rows = case.rows
            if not all_rows and case.first is not None:
                rows = rows[:rows.index(case.first) + 4]
            width = max([len(r.label) for r in rows] + [6])
            out.append(f"{'module':<{width}} {'shape':<20} {'max abs':>9} {'max rel':>9}  first bad")
            for r in rows:
                if not r.reached:
                    out.append(f"{r.label:<{width}} {str(r.shape):<20} {'not reached':>19}  -  {r.note}")
                    continue
                first = "-" if r.first_bad is None else str(tuple(r.first_bad))
                out.append(f"{r.label:<{width}} {str(r.shape):<20} {r.max_abs:>9.2g} {r.max_rel:>9.2g}  "
                           f"{first}{'  ' + r.note if r.note else ''}{'' if r.ok else '  <--'}")
        groups: dict[tuple, list[Culprit]] = {}  # one line per culprit, however many sizes show it
        for c in self.culprits():
            groups.setdefault((c.module, c.call, c.failed, c.new_at_size, c.new_on_image), []).append(c)
        out += [str(replace(cs[0], case=", ".join(c.case for c in cs))) for cs in groups.values()]
        if not groups:
            tied = [f"{c.name}: {_tie(p)}" for c in self.cases for p in c.ties]
            out += (["a near-tie, not a fault: with the graph's picks imposed on eager, no module diverges"]
                    + [f"  {line}" for line in tied]) if tied else ["no module diverges at any size"]
        return "\n".join(out)

    def to_dict(self) -> dict:
        culprit = self.culprit()
        return {"diverged": culprit is not None, "culprit": None if culprit is None else asdict(culprit),
                "cases": [{"name": c.name, "error": c.error, "error_module": c.error_module,
                           "first": None if c.first is None else asdict(c.first),
                           "not_reached": [r.label for r in c.not_reached],
                           "ties": [asdict(p) for p in c.ties]} for c in self.cases]}


def _tie(p) -> str:
    return f"{p.node}, {p.positions} slot{'s' if p.positions != 1 else ''} (largest gap {p.gap:.2g}, bound {p.bound:.2g})"


# ------------------------------------------------------------------------------------------------------ comparison
def compare(expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float,
            max_mismatch: float = 0.0) -> tuple[float, float, list | None, bool]:
    """(max abs, max rel, first element past atol + rtol·|expected|, within tolerance): verification's measure."""
    d = difference(expected, actual, atol, rtol, max_mismatch)
    return d.max_abs, d.max_rel, d.first_bad, d.ok


_NODE = re.compile(r"Name:'([^']*)'")


def module_of_node(message: str, root: nn.Module | None = None) -> str | None:
    """The module owning the node an onnxruntime error names, from the scope the TorchScript exporter encodes in node
    names ('/adapter/testr/input_proj.1/Reshape_2'); with `root`, as `root`'s path of it ('model.testr.input_proj.1':
    scope names follow the attribute a module was called through, so match the longest suffix of any alias)."""
    m = _NODE.search(message)
    if not m or "/" not in m.group(1):
        return None
    parts = m.group(1).strip("/").split("/")[:-1]
    if root is not None:
        canonical = {id(mod): p for p, mod in root.named_modules()}
        aliases = [(p, canonical[id(mod)]) for p, mod in root.named_modules(remove_duplicate=False) if p]
        for k in range(len(parts)):
            suffix = ".".join(parts[k:])
            for alias, path in aliases:
                if alias == suffix or alias.endswith("." + suffix):
                    return path
    return ".".join(parts)


# ------------------------------------------------------------------------------------------------------ the ladder
def run_ladder(adapter: nn.Module, settings, scope: Callable[[], ContextManager], export_images: Sequence[np.ndarray],
               cases: Mapping[str, Sequence[np.ndarray]] = (), *, rungs: Sequence[str] | None = None,
               atol: float = 1e-3, rtol: float = 1e-3, max_mismatch: float = 1e-3,
               providers: Sequence[str] = ("CPUExecutionProvider",),
               output_tolerances: Mapping[str, tuple[float, float]] | None = None) -> LadderReport:
    """Export `adapter` (as `settings` — exporter, opset, dynamic — say, inside `scope()`) with every rung's output
    as an extra graph output, then compare each against eager PyTorch outside the scope: first on `export_images`,
    then on every case (name → images). Rows compare within `atol`, `rtol`; the adapter's own outputs within
    `output_tolerances[name]` where given (verification's, by kind). Nothing is written outside a temporary
    directory."""
    paths = list(default_rungs(adapter) if rungs is None else rungs)
    args = torch_inputs(adapter, export_images)
    with tempfile.TemporaryDirectory(prefix="d2export-ladder-") as tmp, scope():
        with torch.no_grad(), Recorder(adapter, paths) as probe:
            adapter(*args)
        keys = list(probe.records)
        names = [f"ladder:{p or ROOT}#{c}{w}" for p, c, w in keys]
        axes = None
        if settings.dynamic:
            axes = dict(adapter.dynamic_axes)
            axes.update({n: {d: f"{n}_d{d}" for d in range(probe.records[k].dim())} for n, k in zip(names, keys)})
        wrapper = _WithRungs(adapter, paths, keys)
        result = export_onnx(wrapper, args, Path(tmp) / "ladder.onnx", input_names=adapter.input_names,
                             output_names=list(adapter.output_names) + names, dynamic_axes=axes,
                             opset=settings.opset, exporter=settings.exporter)
        options = check_sessions.session_options(result.path)
        options.log_severity_level = 3  # a run that fails is reported below, not logged twice
        session, selections = near_ties.selecting_session(result.path, options, providers)
    warns = [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in result.tracer_warnings]
    report = LadderReport([], probe.sources, {}, list(dict.fromkeys(warns)), result.node_count, atol, rtol)
    export_name = "export input " + "+".join(f"{im.shape[-2]}x{im.shape[-1]}" for im in export_images)
    for name, images in [(export_name, export_images), *dict(cases).items()]:
        report.cases.append(_run_case(name, adapter, paths, (session, selections, wrapper.untraced), names, keys,
                                      images, report, atol, rtol, max_mismatch, dict(output_tolerances or {})))
    return report


def _run_case(name, adapter, paths, graph_session, names, keys, images, report, atol, rtol, max_mismatch,
              output_tolerances) -> CaseReport:
    """The graph first, then eager with the graph's near-tied TopK picks imposed (exporting/pinning.py): past a
    selection that differs only by float noise, rows compare like for like, so a real fault downstream is still
    named at its module and a tie alone is reported as one."""
    session, selections, untraced = graph_session
    case = CaseReport(name, [tuple(im.shape[-2:]) for im in images])
    feeds = graph_inputs(adapter, images)
    used = {i.name for i in session.get_inputs()}  # the exporter drops inputs the graph never reads
    try:
        values, picks = pinning.graph_picks(session, selections, [o.name for o in session.get_outputs()],
                                            {k: v for k, v in feeds.items() if k in used})
    except Exception as e:  # noqa: BLE001 - a graph that fails at this size is a finding, not a crash
        values, picks = None, []
        case.error, case.error_module = str(e).strip().splitlines()[0], module_of_node(str(e), adapter)
    with torch.no_grad(), pinning.pinned_selections(picks, pinning.Tolerances(atol, rtol, atol)) as pinner, \
            Recorder(adapter, paths) as eager:  # outside the export scope: the model's own code
        adapter(*torch_inputs(adapter, images))
    case.ties = [p for p in pinner.found if p.tied]
    for path, src in eager.sources.items():
        report.model_sources.setdefault(path, src)
    if values is None:
        return case
    graph = {key: values[n] for key, n in zip(keys, names) if key not in untraced}
    outputs = {f"[{i}]": n for i, n in enumerate(adapter.output_names)}
    for (path, call, where), t in eager.records.items():
        expected = t.cpu().numpy()
        output = outputs.get(where) if path == "" else None  # the adapter's outputs by their graph names
        part = f" {output}" if output else where
        tolerance = output_tolerances.get(output, (atol, rtol))
        actual = graph.get((path, call, where))
        if actual is None:
            note = "Python values in the traced program" if (path, call, where) in untraced else "not in the graph"
            case.rows.append(Row(path, call, part, list(expected.shape), 0.0, 0.0, None, False, note, reached=False))
            continue
        max_abs, max_rel, first, ok = compare(expected, actual, *tolerance, max_mismatch)
        note = "" if expected.shape == actual.shape else f"onnx shape {list(actual.shape)}"
        case.rows.append(Row(path, call, part, list(expected.shape), max_abs, max_rel, first, ok, note))
    return case


@contextlib.contextmanager
def no_scope():
    """For `run_ladder(scope=...)` when the export needs no patches."""
    yield


# -------------------------------------------------------------------------------------------- for a prepared model
def ladder(built, sizes: Sequence[Sequence[int]] | None = None, route: str | None = None):
    """The parity ladder (docs/ladder.md) for a prepared model (the pipeline's Built): its export settings and
    scope through `route` (the exporter that wrote the graph; default: the config's, `auto`'s first), the export's
    dummy input first, then one image per size (the verification sizes by default). Call it with no export scope
    open: it opens its own around a throwaway export."""
    cfg, tol = built.cfg, float32_tolerances(built.cfg)
    route = route or routes(cfg.export.exporter)[0]
    sizes = [tuple(s) for s in (sizes or verification_sizes(cfg, getattr(built, "size_divisibility", 0)))]
    cases = {f"{h}x{w}": dummy_images([(h, w)], seed=2000 + 10 * i) for i, (h, w) in enumerate(sizes)}
    return run_ladder(built.adapter, replace(cfg.export, exporter=route), lambda: export_scope(built),
                      dummy_images(traced_sizes(cfg, built.adapter.batchable, route), cfg.model.seed), cases,
                      atol=max(tol.atol, tol.pixel_atol),  # inner tensors have no kind: the loosest
                      rtol=tol.rtol, max_mismatch=tol.max_mismatch, providers=cfg.verify.providers,
                      output_tolerances=tol.per_output(built.adapter.output_names, built.family.output_kinds))


def _ladder_summary(subject) -> dict:
    """The parity ladder of `subject` (through the route that wrote its graph) run and logged: its report, as the
    manifest keeps it. A diagnosis: where it crashes, that is an error in the report (logged as one, `error` in the
    summary, a line in a refusal), and the verification's own verdict stands beside it (the crash must not stand in
    for a refusal's figures, nor read as a clean ladder)."""
    try:
        with progress.busy("parity ladder"):
            report = ladder(subject.built, route=subject.exporter)
    except Exception as e:  # noqa: BLE001
        log.error("parity ladder: crashed, no module compared (%s: %s)", type(e).__name__, e)
        return {"diverged": None, "culprit": None, "cases": [], "error": f"{type(e).__name__}: {e}"}
    log.log(logging.WARNING if report.culprit() else logging.INFO, "parity ladder:\n%s", report.format())
    return report.to_dict()
