"""torch → ONNX: export to a temporary file, check, optionally slim, then rename into place.

Nothing half-written is ever left at the destination: a failure anywhere removes the temporary file.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import onnx
import torch

from d2export.config import EXPORTERS, D2ExportConfig
from d2export.exporting.export_diagnosis import describe_export_failure, record_at_user_line
from d2export.exporting.fused_op_translation import translations
from d2export.exporting.size_assumptions import Assumptions, size_assumptions
from d2export.exporting.torch_export_capture import capture, dynamic_shapes
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
    exporter: str = "torchscript"  # the route that wrote the graph (export.exporter=auto chooses it at export)


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
            warnings.showwarning = functools.partial(record_at_user_line, caught)
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
    return ExportResult(path, time.perf_counter() - start, caught, len(model.graph.node), assumed, exporter)


def routes(exporter: str) -> list[str]:
    """The exporters `export.exporter` tries, in order: `auto` is TorchScript's, then torch.export's where that fails
    (the route PyTorch keeps)."""
    return ["torchscript", "dynamo"] if exporter == "auto" else [exporter]


def traced_sizes(cfg: D2ExportConfig, batchable: bool = True, route: str | None = None) -> list[tuple[int, int]]:
    """The dummy batch the graph is traced on through `route` (default: the config's; `auto` starts with
    TorchScript's). torch.export specialises a dimension of size 1 to a constant, so a single dummy image gets a twin
    there (a dynamic batch must be traced at 2 or more) where the graph takes a batch (`batchable`: its adapter's;
    detectron2's own detectors take one image per run)."""
    sizes = [tuple(s) for s in cfg.export.dummy_sizes]
    if (route or cfg.export.exporter) == "dynamo" and cfg.export.dynamic and batchable and len(sizes) == 1:
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
            shapes = dynamic_shapes(args, input_names, dynamic_axes)
            # torch.export translates to opset 18 and up; asked for less, it tries onnx's version converter, which
            # has no adapter for these graphs' Pad, and prints the converter's traceback: the graph stays at 18
            kwargs["opset_version"] = max(opset, 18)
            # the route's phases said as they end: each takes minutes on a full-size model
            with _phase("torch.export captured the program"):
                captured = capture(module, args, shapes)
                assumed = size_assumptions(captured, input_names, dynamic_axes or {})
            with _quiet_loggers("onnxscript", "onnx_ir"):  # a line per rewrite and folded node at INFO
                with _phase("torch.onnx decomposed and translated it"):
                    program = torch.onnx.export(captured, dynamo=True, optimize=False, verbose=False,
                                                custom_translation_table=translations(), **kwargs)
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


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        import onnxslim
    except ImportError as e:
        raise ExportError("export.simplify=true needs onnxslim: pip install 'd2export[slim]'") from e
    return onnxslim.slim(model)
