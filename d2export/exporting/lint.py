"""Lint an export for shapes baked in from the dummy input.

Through TorchScript, two signals, both cheap next to a silent wrong answer in production:
- the same model traced at a second dummy size must give the same graph; constants that differ between the two
  traces follow the input's size, and are named with the graph node (whose name carries the module scope);
- TracerWarnings ("converting a tensor to a Python integer", "as_tensor results are registered as constants") point
  at the user's source lines where a value left the graph.
Through torch.export, whose trace is symbolic, what its capture assumed of the dynamic sizes (a fixed axis, a
narrowed range, a runtime assert torch.onnx drops: exporting/size_assumptions.py), read off the one capture: it
sees branches a second size would take the same way, and costs no second export.
"""
from __future__ import annotations

import tempfile
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from d2export import progress
from d2export.exporting.onnx_export import ExportResult, export_onnx, traced_sizes
from d2export.tracing import dummy_images, torch_inputs


@dataclass
class LintReport:
    identical: bool = True
    size_dependent_constants: list[dict] = field(default_factory=list)
    tracer_warnings: list[dict] = field(default_factory=list)
    size_assumptions: list[str] = field(default_factory=list)  # through torch.export: what it assumed of the sizes
    min_sizes: dict[str, int] = field(default_factory=dict)  # through torch.export: the least sizes it holds at
    never_one: list[str] = field(default_factory=list)  # through torch.export: axes traced as never 1
    below_minimum: dict = field(default_factory=dict)  # tried below min_sizes (float32.check_below_minimums)

    @property
    def serve_from(self) -> dict[str, int]:
        """The sizes the runtime pads smaller pictures up to: the minimums where the graph was found answering
        differently below them; none where it held, or where nothing below could be tried (a minimum the sampled
        classification misread, or one the model itself cannot go under: padding would change every answer)."""
        return dict(self.min_sizes) if self.below_minimum.get("failed") else {}

    @property
    def clean(self) -> bool:
        return self.identical and not self.size_dependent_constants and not self.size_assumptions

    def to_dict(self) -> dict:
        return asdict(self) | {"clean": self.clean, "serve_from": self.serve_from}

    def format(self) -> str:
        if self.size_assumptions:
            lines = ["lint: torch.export's graph holds only for some sizes: it assumed"]
            lines += [f"  {a}" for a in self.size_assumptions[:20]]
        else:
            lines = ["lint: the graph does not depend on the dummy's size" if self.clean else
                     "lint: the graph CHANGES with the dummy's size: these constants follow it"]
        if self.min_sizes:
            lines.append("lint: torch.export assumed " + ", ".join(f"{k} >= {v}" for k, v in self.min_sizes.items()))
        below = self.below_minimum
        if below.get("held"):
            lines.append(f"lint: the graph agrees with the model below that too ({', '.join(below['tried'])}"
                         f"{'; the model itself fails at ' + below['eager_fails'] if below['eager_fails'] else ''}): "
                         "served at any size")
        elif below.get("failed"):
            lines.append(f"lint: the graph answers differently below it (at {below['failed']}): the runtime pads "
                         "smaller pictures up to it")
        elif below:  # nothing tried: the model failed at the first size below, or no size below is 8 px or more
            why = (f"the model itself fails at {below['eager_fails']}" if below.get("eager_fails")
                   else "no size below it of 8 px or more")
            lines.append(f"lint: not tried below it ({why}): served as exported")
        if self.never_one:
            lines.append(f"lint: traced as never 1 (the verification's cases at 1 decide): {', '.join(self.never_one)}")
        for c in self.size_dependent_constants[:20]:
            lines.append(f"  {c['node']}: {c['first']} vs {c['second']}")
        for w in self.tracer_warnings[:20]:
            lines.append(f"  TracerWarning x{w['count']} at {w['where']}: {w['message']}")
        return "\n".join(lines)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    found = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for i, node in enumerate(model.graph.node):
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    found[node.name or f"Constant_{i}:{node.output[0]}"] = numpy_helper.to_array(attr.t)
    return found


def _summary(a: np.ndarray) -> str:
    return str(a.tolist()) if a.size <= 8 else f"{a.dtype}{list(a.shape)}"


def compare_graphs(first: onnx.ModelProto, second: onnx.ModelProto) -> tuple[bool, list[dict]]:
    if first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True):
        return True, []
    a, b = _constants(first), _constants(second)
    diffs = []
    for name in a.keys() & b.keys():
        x, y = a[name], b[name]
        if x.shape != y.shape or not np.array_equal(x, y):
            diffs.append({"node": name, "first": _summary(x), "second": _summary(y)})
    structure = [n.op_type for n in first.graph.node] != [n.op_type for n in second.graph.node]
    if structure:
        diffs.append({"node": "<graph structure>", "first": f"{len(first.graph.node)} nodes",
                      "second": f"{len(second.graph.node)} nodes"})
    return False, sorted(diffs, key=lambda d: d["node"])


def summarise_warnings(caught: list[warnings.WarningMessage]) -> list[dict]:
    """One entry per source line and message (whole: a cut message hides what went wrong), with its count."""
    counts = Counter((f"{w.filename}:{w.lineno}", " ".join(str(w.message).split())) for w in caught)
    return [{"where": where, "message": msg, "count": n} for (where, msg), n in counts.most_common()]


def lint_export(built, staged: Path, result: ExportResult, axes: dict | None) -> LintReport:
    """The lint of the graph at `staged`, exported from `built` (the pipeline's Built) as `result` with dynamic `axes`:
    its tracer warnings, and for a dynamic export the constants that change when traced at a second size (through
    torch.export: what its capture assumed of the sizes)."""
    report = LintReport(tracer_warnings=summarise_warnings(result.tracer_warnings))
    if axes is None:
        return report  # a static export is size-specific by request
    if result.size_assumptions is not None:
        report.size_assumptions = result.size_assumptions.conditions
        report.min_sizes = result.size_assumptions.minimum
        report.never_one = result.size_assumptions.never_one
        return report
    sizes = traced_sizes(built.cfg, built.adapter.batchable, result.exporter)
    h, w = sizes[0]
    second = [(h + 32, max(64, w - 32))] + [tuple(s) for s in sizes[1:]]
    with tempfile.TemporaryDirectory() as tmp, progress.busy("lint: tracing at a second size"):
        e = built.cfg.export
        export_onnx(built.adapter, torch_inputs(built.adapter, dummy_images(second, 7)), Path(tmp) / "second.onnx",
                    input_names=built.adapter.input_names, output_names=built.adapter.output_names,
                    dynamic_axes=axes, opset=e.opset, exporter=result.exporter)
        report.identical, report.size_dependent_constants = compare_graphs(
            onnx.load(str(staged)), onnx.load(str(Path(tmp) / "second.onnx")))
    return report
