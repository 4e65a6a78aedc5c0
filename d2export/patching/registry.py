"""The patch registry: declared, target-scoped, reversible patches that report what the export went through.

A patch names what it replaces, why, and which targets need it (`Needs`). Four kinds, chosen by the keyword given to
`register_patch`:

- ``function="torch.inverse"`` (or a tuple of dotted paths): a function, method or class attribute is replaced. The
  replacement takes the original's arguments and may return ``NotImplemented`` to defer to the original for calls
  it does not rewrite (counted as `deferred`, not as hits). Call sites that bound the name earlier
  (``from torch import inverse``) are caught only in modules named by ``apply_patches(rebind_in=...)``.
- ``module=predicate`` (a class, a class name, or ``(name, module) -> bool``) with ``method="forward"``: every matching
  submodule of the model gets that method replaced (a function taking ``self`` first), or, when the replacement is an
  ``nn.Module`` subclass, its ``__class__`` swapped (weights stay; detectron2's trick). A class or class name is
  patched on that class, so subclasses inherit the patch (and a `super()` call reaches it); a subclass that
  overrides the method keeps its own, untouched. A predicate's matches get an instance-level override.
- ``autograd="pkg.mod.SomeFunction"`` (or a predicate over classes): ``SomeFunction.apply`` is replaced. Aliases bound
  before the scope (``f = SomeFunction.apply``) are not caught.
- ``graph=True``: a pass over the exported ``onnx.ModelProto`` returning how many nodes it rewrote; the export
  pipeline runs it with `PatchReport.run_graph_patches` after export.

Stand-ins for missing compiled extensions are not patches: they must answer imports before the user's code loads,
outside any scope, so the one import hook is `compiled_ops.py`'s finder (`d2export.activate()`).

`apply_patches` is a context manager: everything is restored on exit (also on exceptions, also when nested), and
the yielded `PatchReport` counts hits while the scope is open.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from d2export.patching import jit_view

RUNTIMES = ("onnxruntime", "tensorrt")
_MISSING = object()


@dataclass(frozen=True)
class Target:
    """What the export is for. `version` is the runtime's version (e.g. (8, 6) for TensorRT 8.6); None = current."""

    opset: int = 17
    runtime: str = "onnxruntime"
    version: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")


@dataclass(frozen=True)
class Needs:
    """One condition under which a patch is needed: opset in the inclusive range, runtime listed, and (if given)
    the target's runtime version below `version_below`."""

    opsets: tuple[int, int] = (1, 10_000)
    runtimes: tuple[str, ...] = RUNTIMES
    version_below: tuple[int, ...] | None = None

    def matches(self, target: Target) -> bool:
        lo, hi = self.opsets
        old_enough = self.version_below is None or (target.version is not None and target.version < self.version_below)
        return lo <= target.opset <= hi and target.runtime in self.runtimes and old_enough

    def __str__(self) -> str:
        lo, hi = self.opsets
        parts = []
        if (lo, hi) != Needs().opsets:
            parts.append(f"opset {lo}-{hi}" if hi < 10_000 else f"opset >={lo}")
        if self.runtimes != RUNTIMES or self.version_below:
            below = f" <{'.'.join(map(str, self.version_below))}" if self.version_below else ""
            parts.append("/".join(self.runtimes) + below)
        return " ".join(parts) or "always"


ALWAYS = Needs()


def has_attrs(*names: str) -> Callable[[str, Any], bool]:
    """Duck-typed module predicate: the module has every one of these attributes."""

    def predicate(name: str, module: Any) -> bool:
        return all(hasattr(module, n) for n in names)

    predicate.__qualname__ = f"has_attrs({', '.join(names)})"
    return predicate


def module_where(has: Callable[[Any], bool]) -> Callable[[str, Any], bool]:
    """The registry's (name, module) predicate from a duck-typing test of the module alone."""
    return lambda name, module: has(module)


def forward_args(module) -> list[str]:
    """The names of a module's forward arguments after self (its class's, whatever an instance overrides): what
    duck-typing tests read."""
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


# ---------------------------------------------------------------------------------------------------------- report
@dataclass
class PatchRecord:
    """One patch's line in the report. `sites`: places patched; `hits`: calls rewritten; `deferred`: calls the
    replacement handed back to the original."""

    name: str
    kind: str
    replaces: str
    why: str
    needed_for: str
    active: bool = False
    excluded: bool = False
    sites: int = 0
    hits: int = 0
    deferred: int = 0
    note: str = ""

    @property
    def status(self) -> str:
        if self.excluded:
            return "excluded"
        if not self.active:
            return "not-needed"
        return "applied" if self.hits else "unused"

    def to_dict(self) -> dict:
        keys = ("name", "kind", "replaces", "why", "needed_for", "status", "sites", "hits", "deferred", "note")
        return {k: getattr(self, k) for k in keys}


@dataclass
class PatchReport:
    target: Target | None
    records: list[PatchRecord] = field(default_factory=list)
    _graph_passes: list[tuple[PatchRecord, Callable]] = field(default_factory=list, repr=False)

    def __getitem__(self, name: str) -> PatchRecord:
        for r in self.records:
            if r.name == name:
                return r
        raise KeyError(name)

    def by_status(self, status: str) -> list[str]:
        return [r.name for r in self.records if r.status == status]

    def run_graph_patches(self, model) -> int:
        """Run the active graph patches over an exported onnx.ModelProto (in place); returns nodes rewritten."""
        total = 0
        for record, graph_pass in self._graph_passes:
            n = int(graph_pass(model))
            record.sites += 1  # a graph pass counts as applied once it has run
            record.hits += n
            total += n
        return total

    def to_dict(self) -> dict:
        target = None if self.target is None else {**vars(self.target)}
        return {"target": target, "patches": [r.to_dict() for r in self.records]}

    def __str__(self) -> str:
        """Two parts: a table of the patches that rewrote something, then one line naming those installed for the
        target that this model never called (available, not failures)."""
        applied = [r for r in self.records if r.status == "applied"]
        head = ("patch", "kind", "status", "sites", "hits", "needed for", "note")
        rows = [head] + [(r.name, r.kind, r.status, str(r.sites), str(r.hits), r.needed_for, r.note) for r in applied]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if not applied:
            lines.append("(none: this model needed no rewrite for this target)")
        unused = [r.name for r in self.records if r.status == "unused"]
        if unused:
            lines.append(f"available for this target, not called by this model ({len(unused)}): {', '.join(unused)}")
        excluded = self.by_status("excluded")
        if excluded:
            lines.append(f"excluded by request: {', '.join(excluded)}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------- kinds
def _counted(replacement: Callable, original: Callable, record: PatchRecord) -> Callable:
    """Wrap a replacement so that calls are counted and NotImplemented defers to the original. Calls the
    replacement's signature cannot take (the original's other keyword names, `out=`) go to the original too."""
    accepts = _binder(replacement)

    @functools.wraps(replacement)
    def patched(*args, **kwargs):
        out = replacement(*args, **kwargs) if accepts(args, kwargs) else NotImplemented
        if out is NotImplemented:
            record.deferred += 1
            return original(*args, **kwargs)
        record.hits += 1
        return out

    return patched


def _binder(fn: Callable) -> Callable[[tuple, dict], bool]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: hand it every call
        return lambda args, kwargs: True

    def accepts(args, kwargs) -> bool:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            return False
        return True

    return accepts


def _set_attr(stack: contextlib.ExitStack, owner: Any, attr: str, value: Any) -> None:
    """setattr, undone on exit: the previous own attribute is restored, or the attribute deleted if it was inherited."""
    own = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    setattr(owner, attr, value)

    def undo():
        if own is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)

    stack.callback(undo)


def resolve(path: str) -> tuple[Any, str]:
    """'torch.Tensor.any' -> (torch.Tensor, 'any'): import the longest module prefix, then walk attributes."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise AttributeError(f"{path}: no attribute {parts[-1]!r}")
        return owner, parts[-1]
    raise ImportError(f"cannot import any module prefix of {path!r}")


@dataclass
class Patch:
    name: str
    why: str
    when: tuple[Needs, ...]
    replacement: Any
    kind = "patch"

    @property
    def replaces(self) -> str:
        raise NotImplementedError

    def needed(self, target: Target | None) -> bool:
        return target is None or any(n.matches(target) for n in self.when)

    def apply(self, stack: contextlib.ExitStack, record: PatchRecord, scope: "_Scope") -> None:
        raise NotImplementedError


@dataclass
class FunctionPatch(Patch):
    paths: tuple[str, ...] = ()
    kind = "function"

    @property
    def replaces(self) -> str:
        return ", ".join(self.paths)

    def apply(self, stack, record, scope):
        for path in self.paths:
            try:
                owner, attr = resolve(path)
            except (ImportError, AttributeError) as e:
                record.note = f"{path}: {e}"
                continue
            raw = inspect.getattr_static(owner, attr)
            descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
            original = raw.__func__ if descriptor else getattr(owner, attr)  # a classmethod's gets cls first
            patched = _counted(self.replacement, original, record)
            jit_view.mirror(stack, patched, original)  # first: it reads torch.jit's tables before anything is set
            _set_attr(stack, owner, attr, descriptor(patched) if descriptor else patched)
            record.sites += 1
            if isinstance(owner, types.ModuleType):
                record.sites += scope.rebind(stack, original, patched)


@dataclass
class ModulePatch(Patch):
    match: Any = None  # a class, a class name (bare or dotted), or a predicate (name, module) -> bool
    method: str = "forward"
    kind = "module"

    @property
    def replaces(self) -> str:
        what = self.match if isinstance(self.match, str) else getattr(self.match, "__qualname__", repr(self.match))
        return f"{what}.{self.method}"

    def matches(self, name: str, module: Any) -> bool:
        if isinstance(self.match, type):
            return isinstance(module, self.match)
        if isinstance(self.match, str):
            return any(self.match in (c.__name__, _dotted(c)) for c in type(module).__mro__)
        return bool(self.match(name, module))

    def named_class(self, module: Any) -> type | None:
        """The class this patch names, as found in the module's class hierarchy (None for a predicate)."""
        if isinstance(self.match, type):
            return self.match
        if isinstance(self.match, str):
            return next(c for c in type(module).__mro__ if self.match in (c.__name__, _dotted(c)))
        return None

    def apply(self, stack, record, scope):
        if scope.model is None:
            record.note = "no model given"
            return
        swap, patched, kept = isinstance(self.replacement, type), set(), []
        for name, module in list(scope.model.named_modules()):
            if not self.matches(name, module):
                continue
            named = self.named_class(module)
            if named is not None and _overrides(type(module), named, self.method):
                kept.append(type(module).__qualname__)  # the user's subclass's own method: theirs, not ours
                continue
            record.sites += 1
            if swap:
                stack.callback(setattr, module, "__class__", module.__class__)
                module.__class__ = self.replacement
                handle = module.register_forward_pre_hook(lambda *_: setattr(record, "hits", record.hits + 1))
                stack.callback(handle.remove)
            elif named is None or self.method in vars(module):  # a predicate, or an instance's own (an outer scope's)
                original = getattr(module, self.method)
                bound = functools.partial(self.replacement, module)
                _set_attr(stack, module, self.method, _counted(bound, original, record))
            elif named not in patched:  # once, on the class: its subclasses inherit it
                patched.add(named)
                _set_attr(stack, named, self.method, _counted(self.replacement, getattr(named, self.method), record))
        if kept:
            record.note = f"left alone (own {self.method}): {', '.join(sorted(set(kept)))}"


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _overrides(cls: type, named: type, method: str) -> bool:
    """Whether `cls` (a subclass of `named`) or a class between them defines `method` itself."""
    mro = cls.__mro__
    return any(method in vars(c) for c in mro[:mro.index(named)])


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@dataclass
class AutogradPatch(Patch):
    function: Any = None  # dotted path of an autograd.Function subclass, or a predicate over classes
    kind = "autograd"

    @property
    def replaces(self) -> str:
        what = self.function if isinstance(self.function, str) else getattr(self.function, "__qualname__", "?")
        return f"{what}.apply"

    def apply(self, stack, record, scope):
        import torch

        if isinstance(self.function, str):
            try:
                owner, attr = resolve(self.function)
            except (ImportError, AttributeError) as e:
                record.note = str(e)
                return
            classes = [getattr(owner, attr)]
        else:
            classes = [c for c in set(_subclasses(torch.autograd.Function)) if self.function(c)]
        for cls in classes:
            patched = _counted(self.replacement, cls.apply, record)
            _set_attr(stack, cls, "apply", staticmethod(patched))
            record.sites += 1


@dataclass
class GraphPatch(Patch):
    kind = "graph"

    @property
    def replaces(self) -> str:
        return f"ONNX graph: {getattr(self.replacement, '__name__', '?')}"

    def apply(self, stack, record, scope):
        scope.report._graph_passes.append((record, self.replacement))


# -------------------------------------------------------------------------------------------------------- registry
@dataclass
class _Scope:
    model: Any
    rebind_in: tuple[str, ...]
    report: PatchReport

    def rebind(self, stack: contextlib.ExitStack, original: Any, patched: Any) -> int:
        """Point names bound to `original` in modules under `rebind_in` at `patched`; returns how many."""
        count = 0
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not any(mod_name == p or mod_name.startswith(p + ".") for p in self.rebind_in):
                continue
            for attr, value in list(vars(mod).items()):
                if value is original:
                    _set_attr(stack, mod, attr, patched)
                    count += 1
        return count


class PatchRegistry:
    def __init__(self):
        self._patches: dict[str, Patch] = {}

    def __iter__(self) -> Iterator[Patch]:
        return iter(self._patches.values())

    def __getitem__(self, name: str) -> Patch:
        return self._patches[name]

    def __contains__(self, name: str) -> bool:
        return name in self._patches

    def add(self, patch: Patch) -> Patch:
        if patch.name in self._patches:
            raise ValueError(f"a patch named {patch.name!r} is registered already")
        self._patches[patch.name] = patch
        return patch

    def remove(self, name: str) -> Patch:
        return self._patches.pop(name)

    def register(self, name: str, *, why: str, when: Needs | Iterable[Needs] = ALWAYS,
                 function: str | Sequence[str] | None = None, module: Any = None, method: str = "forward",
                 autograd: Any = None, graph: bool = False) -> Callable:
        """Decorator: register the decorated object as the replacement of exactly one kind of target."""
        kinds = {"function": function, "module": module, "autograd": autograd, "graph": graph or None}
        given = [k for k, v in kinds.items() if v is not None]
        if len(given) != 1:
            raise TypeError(f"patch {name!r}: give exactly one of {list(kinds)}, got {given}")
        when = (when,) if isinstance(when, Needs) else tuple(when)

        def decorator(replacement):
            common = dict(name=name, why=why, when=when, replacement=replacement)
            if function is not None:
                patch = FunctionPatch(**common, paths=(function,) if isinstance(function, str) else tuple(function))
            elif module is not None:
                patch = ModulePatch(**common, match=module, method=method)
            elif autograd is not None:
                patch = AutogradPatch(**common, function=autograd)
            else:
                patch = GraphPatch(**common)
            self.add(patch)
            return replacement

        return decorator

    @contextlib.contextmanager
    def apply(self, model=None, target: Target | None = Target(), only: Iterable[str] | None = None,
              exclude: Iterable[str] = (), rebind_in: Iterable[str] = ()) -> Iterator[PatchReport]:
        """Apply the patches `target` needs (all of them when target is None), restricted to `only` and not in
        `exclude`; undo them all on exit. Yields the report, whose hit counts grow while the scope is open."""
        only = None if only is None else set(only)
        exclude = set(exclude)
        unknown = ((only or set()) | exclude) - set(self._patches)
        if unknown:
            raise KeyError(f"unknown patches: {sorted(unknown)}")
        report = PatchReport(target)
        scope = _Scope(model, tuple(rebind_in), report)
        with contextlib.ExitStack() as stack:
            for patch in list(self._patches.values()):
                record = PatchRecord(patch.name, patch.kind, patch.replaces, patch.why,
                                     "; ".join(map(str, patch.when)) or "none (opt-in)")
                report.records.append(record)
                if (only is not None and patch.name not in only) or patch.name in exclude:
                    record.excluded = True
                elif patch.needed(target):
                    record.active = True
                    patch.apply(stack, record, scope)
            yield report
        for record in report.records:
            if record.status == "unused" and not record.note:
                if record.kind == "graph":
                    record.note = "matched nothing" if record.sites else "not run"
                else:
                    record.note = "never called" if record.sites else "matched nothing"


REGISTRY = PatchRegistry()
register_patch = REGISTRY.register
apply_patches = REGISTRY.apply
