"""torch → ONNX: export to a temporary file, check, optionally slim, then rename into place.

Nothing half-written is ever left at the destination: a failure anywhere removes the temporary file.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import traceback
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import onnx
import torch

from d2export.config import EXPORTERS, D2ExportConfig
from d2export.exporting.size_assumptions import Assumptions, size_assumptions
from d2export.manifest import staged

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """The exporter refused the model; the message names the operator and where it came from."""


@dataclass
class ExportResult:
    path: Path
    seconds: float
    tracer_warnings: list[warnings.WarningMessage] = field(default_factory=list)
    node_count: int = 0
    size_assumptions: Assumptions | None = None  # through torch.export: what its capture assumed of the sizes


def export_onnx(
    module: torch.nn.Module,
    args: tuple,
    path: str | os.PathLike,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_axes: dict[str, dict[int, str]] | None = None,
    opset: int = 17,
    exporter: str = "torchscript",
    simplify: bool = False,
) -> ExportResult:
    """Export `module(*args)` to `path` atomically; returns the TracerWarnings seen while tracing."""
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}: choose one of {EXPORTERS}")
    path = Path(path)
    start = time.perf_counter()
    with staged(path) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("always", torch.jit.TracerWarning)
            caught: list[warnings.WarningMessage] = []
            warnings.showwarning = functools.partial(_record_at_user_line, caught)
            try:
                assumed = _run_exporter(module, args, tmp, input_names, output_names, dynamic_axes, opset, exporter)
            except Exception as e:  # the exporter's own errors are long and name no module: say what and where
                raise ExportError(describe_export_failure(e, module, args)) from e
        model = onnx.load(str(tmp))
        if _pin_static_output_dims(model, module, args, dynamic_axes or {}):
            onnx.save(model, str(tmp))
        onnx.checker.check_model(model, full_check=True)
        if simplify:
            model = _slim(model)
            onnx.save(model, str(tmp))
    return ExportResult(path, time.perf_counter() - start, caught, len(model.graph.node), assumed)


def traced_sizes(cfg: D2ExportConfig, batchable: bool = True) -> list[tuple[int, int]]:
    """The dummy batch the graph is traced on. torch.export specialises a dimension of size 1 to a constant, so a
    single dummy image gets a twin there (a dynamic batch must be traced at 2 or more) where the graph takes a batch
    (`batchable`: its adapter's; detectron2's own detectors take one image per run)."""
    sizes = [tuple(s) for s in cfg.export.dummy_sizes]
    if cfg.export.exporter == "dynamo" and cfg.export.dynamic and batchable and len(sizes) == 1:
        sizes = sizes * 2
    return sizes


@contextlib.contextmanager
def export_scope(built) -> Iterator:
    """Everything that must hold while tracing `built` (the pipeline's Built): the configured MSDA sampler and the
    patches the target needs. Yields the patch report. The export, the parity ladder and the benchmarks trace
    through this."""
    from d2export.ops.msda import use_sampler
    from d2export.patching import Target, apply_patches

    e = built.cfg.export
    with use_sampler(e.sampler), apply_patches(model=built.model, target=Target(e.opset, e.target)) as report:
        yield report


def _record_at_user_line(caught, message, category, filename, lineno, file=None, line=None):
    """A TracerWarning names the torch frame that raised it (torch/nn/functional.py, …); record it at the
    innermost frame of the model's own code instead, which is where a value left the graph."""
    if not issubclass(category, torch.jit.TracerWarning):
        return
    if not _is_model_code(filename):
        for frame in reversed(traceback.extract_stack()[:-1]):
            if _is_model_code(frame.filename):
                message = f"{message} (raised in {filename}:{lineno})"
                filename, lineno = frame.filename, frame.lineno
                break
    caught.append(warnings.WarningMessage(message, category, filename, lineno))


def _is_model_code(filename: str) -> bool:
    """Not torch, an installed library, the standard library or this exporter: the code being exported."""
    return not ("site-packages" in filename or "/torch/" in filename or filename.startswith("<")
                or filename.startswith(_STDLIB) or "d2export/exporting" in filename)


_STDLIB = os.path.dirname(os.__file__)


def _run_exporter(module, args, dst, input_names, output_names, dynamic_axes, opset, exporter):
    """Writes the graph to `dst`; through torch.export, returns what the capture assumed of the dynamic axes' sizes
    (size_assumptions), through TorchScript None (its lint traces again)."""
    module.eval()  # torch.onnx.export leaves a wrapper's own mode alone
    kwargs = dict(input_names=list(input_names), output_names=list(output_names), opset_version=opset)
    with torch.no_grad():
        if exporter == "torchscript":
            torch.onnx.export(module, args, str(dst), dynamic_axes=dynamic_axes, dynamo=False,
                              do_constant_folding=True, **kwargs)
        else:
            shapes = _dynamic_shapes(args, input_names, dynamic_axes)
            # torch.export translates to opset 18 and up; asked for less, it tries onnx's version converter, which
            # has no adapter for these graphs' Pad, and prints the converter's traceback: the graph stays at 18
            kwargs["opset_version"] = max(opset, 18)
            # the route's phases said as they end: each takes minutes on a full-size model
            with _phase("torch.export captured the program"):
                captured = _capture(module, args, shapes)
                assumed = size_assumptions(captured, input_names, dynamic_axes or {})
            with _quiet_loggers("onnxscript", "onnx_ir"):  # a line per rewrite and folded node at INFO
                with _phase("torch.onnx decomposed and translated it"):
                    program = torch.onnx.export(captured, dynamo=True, optimize=False, verbose=False,
                                                custom_translation_table=_translations(), **kwargs)
                with _phase("onnxscript folded its constants"):
                    _fold(program.model)
            program.save(str(dst))
            return assumed
    return None


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    log.info("%s in %.1f s", what, time.perf_counter() - start)


def _capture(module, args, shapes) -> torch.export.ExportedProgram:
    """torch.export's program of `module(*args)` as torch.onnx would capture it (non-strict, then strict; a size
    guard the declared axes break retried with torch's suggested fix, as it does), captured here so that the program
    is read before torch.onnx drops its runtime asserts: the lint reads what it assumed of the sizes from it."""
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    def attempt(strict: bool, shapes) -> torch.export.ExportedProgram:
        # as torch.onnx: size-oblivious 0/1 sizes, runtime asserts instead of guards where torch can defer them
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return torch.export.export(module, args, dynamic_shapes=shapes, strict=strict,
                                       prefer_deferred_runtime_asserts_over_guards=True)

    failures = []
    for strict in (False, True):
        try:
            try:
                return attempt(strict, shapes)
            except torch._dynamo.exc.UserError as e:
                try:
                    refined = refine_dynamic_shapes_from_suggested_fixes(e.msg, shapes)
                except Exception:
                    raise e from None  # no fix torch suggests: its own error says what broke
                return attempt(strict, refined)
        except Exception as e:  # noqa: BLE001  (the next way, as torch.onnx tries it)
            failures.append(e)
    raise failures[0]


def _translations() -> dict:
    """d2export's own ops as torch.export records them -> their ONNX nodes: the fused MSDA as the one node of
    d2export's domain the TorchScript route writes (float32 and int64 operands, the types its kernel declares)."""
    import onnxscript
    from onnxscript import opset18 as op

    import d2export.ops.msda  # noqa: F401  (registers torch.ops.d2export.fused_msda)
    from d2export.kernels.custom_ops import DOMAIN, FUSED_MSDA, FUSED_MSDA_INPUTS

    _declare(DOMAIN, FUSED_MSDA, FUSED_MSDA_INPUTS, ("float", "int64", "int64", "float", "float"))
    ours = onnxscript.values.Opset(DOMAIN, 1)
    float32, int64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64

    def fused(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return getattr(ours, FUSED_MSDA)(op.Cast(value, to=float32), op.Cast(spatial_shapes, to=int64),
                                         op.Cast(level_start_index, to=int64), op.Cast(sampling_locations, to=float32),
                                         op.Cast(attention_weights, to=float32))

    return {torch.ops.d2export.fused_msda.default: fused}


def _declare(domain: str, name: str, inputs: Sequence[str], types: Sequence[str]) -> None:
    """Our node's schema for onnx (once per process): asked for an opset above 18, the exporter converts its
    opset-18 graph, and onnx's version converter refuses a node it knows no schema of."""
    try:
        from onnx.defs import OpSchema, has, register_schema
    except ImportError:  # onnx < 1.16 registers none: the graph stays at the exporter's opset
        return
    if has(name, domain):
        return
    param = OpSchema.FormalParameter
    register_schema(OpSchema(name, domain, 1, inputs=[param(n, f"tensor({t})") for n, t in zip(inputs, types)],
                             outputs=[param("out", "tensor(float)")]))


def _fold(model) -> None:
    """onnxscript's constant folding and removal of unused nodes (an onnx_ir model, in place), as its optimizer does
    them, without its pattern rewriter: on the tiny Mask2Former that rewriter tried 314,524 matches, over a third of
    the export step, for fusions onnxruntime makes again when a session starts."""
    from onnxscript.optimizer import fold_constants_ir, remove_unused_nodes

    for _ in range(2):  # the optimizer's own two rounds: a fold exposes unused nodes, their removal more folds
        fold_constants_ir(model)
        remove_unused_nodes(model)


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _pin_static_output_dims(model, module, args, dynamic_axes) -> bool:
    """The exporter's shape inference often loses static output dims (queries, points, characters) and names them
    after the node that made them; pin every dim not declared dynamic to its traced value, for consumers (TensorRT,
    Triton) that need them."""
    outputs = model.graph.output
    if all(d.HasField("dim_value") or d.dim_param in _axis_names(dynamic_axes.get(o.name, {}))
           for o in outputs for d in o.type.tensor_type.shape.dim):
        return False
    with torch.no_grad():
        sample = module(*args)
    sample = sample if isinstance(sample, (tuple, list)) else (sample,)
    for out, t in zip(outputs, sample):
        dynamic = dynamic_axes.get(out.name, {})
        for i, d in enumerate(out.type.tensor_type.shape.dim):
            if i in dynamic:
                d.dim_param = dynamic[i]
            else:
                d.dim_value = int(t.shape[i])
    return True


def _axis_names(axes: dict[int, str]) -> set[str]:
    return set(axes.values())


def _dynamic_shapes(args, input_names, dynamic_axes):
    if not dynamic_axes:
        return None
    dims: dict[str, torch.export.Dim] = {}

    def dim(name: str):
        return dims.setdefault(name, torch.export.Dim(name, min=1))

    return tuple({i: dim(n) for i, n in dynamic_axes.get(name, {}).items()} or None for name in input_names)


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        import onnxslim
    except ImportError as e:
        raise ExportError("export.simplify=true needs onnxslim: pip install 'd2export[slim]'") from e
    return onnxslim.slim(model)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _user_frame(error: BaseException) -> str:
    """The innermost frame outside torch and site-packages across the exception's causes: where the model's code
    was when the exporter gave up."""
    found = ""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in traceback.extract_tb(error.__traceback__):
            if _is_model_code(frame.filename):
                found = f"{frame.filename}:{frame.lineno} ({frame.name}): {frame.line}"
        error = error.__cause__ or error.__context__
    return found


_UNSUPPORTED = re.compile(r"operator '?(?P<op>[\w:.]+)'? to ONNX opset version (?P<opset>\d+)", re.I)


def describe_export_failure(error: Exception, module: torch.nn.Module, args: tuple) -> str:
    """One line that names the unsupported operator and the module paths and source lines that produced it."""
    text = _ANSI.sub("", str(error))
    summary = text.split("## Exception summary", 1)[-1].strip()  # torch.export's errors put the cause there
    msg = summary.splitlines()[0] if summary else type(error).__name__
    m = _UNSUPPORTED.search(text)
    if not m:
        where = _user_frame(error)
        return f"export failed: {msg}" + (f"\n  at {where}" if where else "")
    op = m.group("op")
    where = locate_op(module, args, op if "::" in op else f"aten::{op}")
    lines = [f"unsupported operator {op} at opset {m.group('opset')}"]
    lines += [f"  from {scope or '<top>'} at {source}" for scope, source in where[:5]]
    if not where:
        lines.append("  (could not locate it in the traced graph)")
    return "\n".join(lines)


def locate_op(module: torch.nn.Module, args: tuple, kind: str) -> list[tuple[str, str]]:
    """Module paths and source lines of every `kind` node in a trace of `module(*args)`."""
    names = {m: n for n, m in module.named_modules()}
    saved = torch.jit._trace._trace_module_map
    torch.jit._trace._trace_module_map = names  # makes the tracer record module scopes
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            graph = torch.jit.trace(module, args, check_trace=False, strict=False).inlined_graph
    except Exception:
        return []
    finally:
        torch.jit._trace._trace_module_map = saved
    found = []
    for node in graph.nodes():
        if node.kind() == kind:
            scope = node.scopeName().split("/")[-1].replace("__module.", "")
            found.append((scope, _source_line(node)))
    return list(dict.fromkeys(found))


def _source_line(node) -> str:
    """The innermost frame of the node's recorded Python stack that is the model's own code, not torch's."""
    stack = [line.strip() for line in node.sourceRange().strip().splitlines()]
    own = [line for line in stack if _is_model_code(line)]
    return (own or stack or ["<unknown>"])[0]
