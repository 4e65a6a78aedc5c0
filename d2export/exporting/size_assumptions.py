"""What a torch.export capture assumed about the sizes it was asked to keep dynamic.

torch.export traces with symbolic sizes, so a graph it writes cannot bake the dummy's size silently the way a
TorchScript trace does, but it can narrow what it holds for: an `int(width)` in the model's code becomes a constant,
an `if width > 100` a range, a `height % 32 == 0` a runtime assert, which torch.onnx drops from the ONNX graph, so a
picture outside the assumption takes the dummy's branch. These are the lint of that route, read off the captured
program (its inputs' symbolic shapes, its symbols' ranges and its runtime asserts) instead of tracing the model a
second time, and said with the axes' names.

Most programs assume something harmless: size-oblivious tracing asserts that no feature level is a single pixel
(`(width - 1) // 64 != 0`) and that the batch is not 1 (the dummy's is 2; the verification's single pictures decide
that one), a top-k that there are enough tokens. Each condition is tried at sampled sizes: one that holds at every
size from some minimum up is a minimum size (recorded, not a warning); one that excludes only 1, an axis traced as
never 1; one that holds everywhere (from the minimums up) is dropped; any other is an assumption the lint warns of.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import sympy
import torch
from torch.utils._sympy.numbers import int_oo

_ASSERTS = {torch.ops.aten._assert_scalar.default}
# sizes a condition is tried at: every small size (where levels reach one pixel), then around powers of two and
# multiples of 32 (where divisibility conditions flip), up to beyond any picture served
_SIZES = sorted(set(range(1, 34)) | {v + d for v in (48, 64, 96, 128, 200, 256, 333, 512, 640, 800, 1024, 1333, 2048)
                                     for d in (-1, 0, 1)})
_BATCHES = (1, 2, 3, 4)
_BATCH = "batch"  # the batch axis's name in the adapters' dynamic axes: tried at _BATCHES, never a minimum


@dataclass
class Assumptions:
    minimum: dict[str, int] = field(default_factory=dict)  # axis name -> the least size the graph holds at
    never_one: list[str] = field(default_factory=list)  # axes traced as never 1 (torch.export's size-oblivious 0/1)
    conditions: list[str] = field(default_factory=list)  # anything else: the lint warns of these


def size_assumptions(program: torch.export.ExportedProgram, input_names: Sequence[str],
                     dynamic_axes: dict[str, dict[int, str]]) -> Assumptions:
    """What the program assumes of its inputs' dynamic axes (input_names in the order of the program's user inputs)."""
    inputs = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user = [inputs[name] for name in program.graph_signature.user_inputs]
    found, names, traced = Assumptions(), {}, {}  # names: symbol -> the axis name it stands for; traced: its size
    for name, node in zip(input_names, user):
        shape = node.meta["val"].shape
        for axis, dim in sorted(dynamic_axes.get(name, {}).items()):
            size = shape[axis]
            if not isinstance(size, torch.SymInt):
                found.conditions.append(f"{name} axis {axis} ({dim}) is fixed at {size}")
                continue
            expr = size.node.expr
            if not isinstance(expr, sympy.Symbol):
                found.conditions.append(f"{name} axis {axis} ({dim}) is {expr}")
            elif names.setdefault(expr, dim) != dim:
                found.conditions.append(f"{dim} equals {names[expr]}")
            elif size.node.hint is not None:
                traced[dim] = int(size.node.hint)
    rename = {symbol: sympy.Symbol(dim, integer=True, positive=True) for symbol, dim in names.items()}
    conditions = []
    for symbol in names:
        bounds = program.range_constraints.get(symbol)
        if bounds is not None and bounds.lower > 1:
            conditions.append(sympy.Ge(rename[symbol], int(bounds.lower)))
        if bounds is not None and bounds.upper is not int_oo:
            conditions.append(sympy.Le(rename[symbol], int(bounds.upper)))
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in _ASSERTS and isinstance(node.args[0], torch.fx.Node):
            cond = node.args[0].meta.get("val")
            expr = getattr(getattr(cond, "node", None), "expr", None)
            if expr is not None and expr.free_symbols and expr.free_symbols <= rename.keys():
                conditions.append(expr.xreplace(rename))
    _classify(list(dict.fromkeys(conditions)), found, traced)
    return found


def _classify(conditions: list, found: Assumptions, traced: dict[str, int] | None = None) -> None:
    """Sort the conditions into found: one axis's first (its minimum), then those of several axes, tried only where
    every axis is at its minimum or more (a condition the minimums imply is dropped). traced: axis name -> the size
    the capture saw (no minimum is set above it)."""
    for cond in sorted(conditions, key=lambda c: len(c.free_symbols)):
        symbols = sorted(cond.free_symbols, key=str)
        failing = _failing(cond, symbols, [_sizes(s.name, found) for s in symbols])
        if not failing:
            continue  # holds at every size tried (from the minimums up): nothing more assumed
        if len(symbols) == 1 and {values[0] for values in failing} == {1}:
            found.never_one.append(symbols[0].name)  # traced size-obliviously: the verification's cases at 1 decide
            continue
        spatial = [s for s in symbols if s.name != _BATCH]
        least = _least(cond, symbols, spatial, failing, traced or {})
        if least is not None:  # fails only where every axis is below some size (a small picture): a minimum of each
            for symbol in spatial:
                found.minimum[symbol.name] = max(found.minimum.get(symbol.name, 1), least)
            continue
        found.conditions.append(str(cond))


def _least(cond, symbols: list, spatial: list, failing: list, traced: dict[str, int]) -> int | None:
    """The least size m such that the condition holds wherever every spatial axis is m or more (between the sizes
    tried: checked at every m on the way, all axes at m, every batch); None where there is none up to the largest
    size tried, or where m exceeds an axis's traced size: the capture took the condition's branch at that size, so
    a condition failing above it (`Ne(width, 2047)`) is no minimum but an assumption."""
    if not spatial:
        return None
    at = [symbols.index(s) for s in spatial]
    least = max(min(values[i] for i in at) for values in failing) + 1
    batch = [s for s in symbols if s not in spatial]
    while least <= _SIZES[-1] and not all(_holds(cond, {s: least for s in spatial} | dict(zip(batch, b)))
                                          for b in itertools.product(_BATCHES, repeat=len(batch))):
        least += 1
    if least > _SIZES[-1] or any(least > traced.get(s.name, least) for s in spatial):
        return None
    return least


def _sizes(axis: str, found: Assumptions) -> Sequence[int]:
    if axis == _BATCH:
        return _BATCHES
    return [v for v in _SIZES if v >= found.minimum.get(axis, 1)]


# torch's integer functions in size expressions, for numpy (the rest numpy's printer knows)
_NUMPY = {"FloorDiv": np.floor_divide, "PythonMod": np.mod, "Mod": np.mod, "CleanDiv": np.floor_divide}


def _failing(cond, symbols: list, sizes: list[Sequence[int]]) -> list[tuple[int, ...]]:
    """The sampled points (a value per symbol) where the condition fails: evaluated over the whole grid at once
    through numpy (a big condition has thousands of points), checked against sympy's own evaluation at some of them;
    point by point through sympy where numpy cannot say it."""
    points = list(itertools.product(*sizes))
    try:
        grids = np.meshgrid(*[np.asarray(v, dtype=np.int64) for v in sizes], indexing="ij")
        with np.errstate(divide="ignore", invalid="ignore"):  # numpy's 0 for x // 0: the spot checks below see it
            holds = np.broadcast_to(sympy.lambdify(symbols, cond, modules=[_NUMPY, "numpy"])(*grids), grids[0].shape)
        holds = holds.reshape(-1)
        if all(bool(holds[i]) == _holds(cond, dict(zip(symbols, points[i])))
               for i in range(0, len(points), max(1, len(points) // 16))):
            return [p for p, ok in zip(points, holds) if not ok]
    except Exception:  # noqa: BLE001  (an expression numpy's printer cannot write: sympy evaluates it)
        pass
    return [p for p in points if not _holds(cond, dict(zip(symbols, p)))]


def _holds(cond, values: dict) -> bool:
    """Whether the condition holds at these sizes; not where it divides by zero (a feature level of no pixels)."""
    try:
        return bool(cond.xreplace({s: sympy.Integer(v) for s, v in values.items()}))
    except ZeroDivisionError:
        return False
