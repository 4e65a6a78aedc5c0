"""Where in the model's own code the exporter's complaints come from: a failure said as its operator, module paths
and source lines; a TracerWarning recorded at the model's line instead of torch's."""
from __future__ import annotations

import os
import re
import traceback
import warnings

import torch


def record_at_user_line(caught, message, category, filename, lineno, file=None, line=None):
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
