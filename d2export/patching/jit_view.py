"""Keep function patches out of TorchScript's sight: the compiler resolves a wrapper exactly as it resolves the
original it replaced.

`torch.jit.script` compiles whatever Python object a name in scripted code resolves to (torch's C++
`toSugaredValue`), also names read from module globals that a patch has replaced: FPN's `F.interpolate` calls
`adaptive_avg_pool2d` through `torch.nn.functional`'s globals, detectron2's helpers call `torch.as_tensor`. Left
alone, the compiler would compile d2export's wrappers and fail. It looks an object up, in this order, in:

1. the builtin-operator table, keyed by `id` (`torch.as_tensor` → `aten::as_tensor`): the wrapper gets the
   original's entry;
2. the boolean-dispatch table (`F.adaptive_max_pool2d` and its `return_indices` twins): the wrapper gets the
   original's entry;
3. the compiled overloads of a function declared with `@torch.jit._overload` (`F.interpolate`): the original's are
   compiled (torch compiles them on first use anyway) and the wrapper shares them;
4. otherwise it compiles a Python function from source, after asking it `__prepare_scriptable__()` (the hook
   `torch.jit.script` honours for modules and functions): the wrapper answers with the original, so the original's
   source is compiled, with the original's globals.

Entries are removed with the patch. Scripted code therefore always runs the original: rewrites apply where Python
runs (eager, tracing, torch.export), never inside TorchScript — exactly as if the plugin were absent.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable


def mirror(stack: contextlib.ExitStack, wrapper: Callable, original: Any) -> None:
    """Make TorchScript resolve `wrapper` as it resolves `original`, until `stack` closes. Call it before the
    wrapper is installed: torch builds its builtin table lazily from the torch namespace, and must see originals."""
    from torch.jit import _builtins

    table = _builtins._get_builtin_table()
    op = table.get(id(original))
    if op is not None:
        table[id(wrapper)] = op
        stack.callback(table.pop, id(wrapper), None)  # ids are reused once the wrapper is gone
    dispatched = _boolean_dispatched()
    entry = _weak_get(dispatched, original)
    if entry is not None:
        dispatched[wrapper] = entry
        stack.callback(dispatched.pop, wrapper, None)
    overloads = _compiled_overloads(original)
    if overloads is not None:
        overloads[wrapper] = overloads[original]
        stack.callback(overloads.pop, wrapper, None)
    wrapper.__prepare_scriptable__ = lambda: _prepared(original)


def _prepared(original):
    """What TorchScript compiles for `original`: what its own hook answers (the original of an outer scope's wrapper),
    else itself."""
    prepare = getattr(original, "__prepare_scriptable__", None)
    return prepare() if prepare is not None else original


def _compiled_overloads(original):
    """torch.jit's cache of compiled overloads, after compiling `original`'s if it has some; else None."""
    import inspect

    from torch import _jit_internal
    from torch.jit import _script, _state

    if not inspect.isfunction(original):
        return None
    pending = _jit_internal._get_fn_overloads(_jit_internal._qualified_name(original))
    if pending is None and _state._try_get_jit_cached_overloads(original) is None:
        return None
    _script._get_overloads(original)  # compiles and caches them, as scripting a caller would
    return _state._jit_function_overload_caching


def _boolean_dispatched():
    from torch import _jit_internal

    return _jit_internal.boolean_dispatched


def _weak_get(table, key):
    try:
        return table.get(key)
    except TypeError:  # not weak-referenceable (C methods): never a boolean-dispatch function
        return None
