"""The kinds of output a served model answers beyond its detections' common fields, one declaration each
(`declaration.ServedKind`), in a fixed order: the order of their fields, JSON keys, files and `batch` columns.

Everything that serves, draws or evaluates a prediction iterates over `kinds()` instead of naming one: `Prediction`
and `Instance` (d2export/instances.py) take their fields from here, so a new kind is one module here, named in
`MODULES`. Torch-free (numpy and Pillow only), below d2export/instances.py.
"""
from __future__ import annotations

from d2export.served_kinds import language, panoptic, semantic
from d2export.served_kinds.declaration import ServedKind

MODULES = (semantic, panoptic, language)  # each declares KINDS; this order is the fields' and the columns' order

_KINDS: list[ServedKind] = []
_sealed = False


def register(kind: ServedKind) -> None:
    """Adds a kind after those declared. Only before d2export/instances.py is imported: its dataclasses are made
    once, with the fields of the kinds registered by then."""
    if _sealed:
        raise RuntimeError(f"served kind {kind.name!r}: register it before d2export.instances is imported (its "
                           "dataclasses already have their fields)")
    if any(k.name == kind.name for k in _KINDS):
        raise ValueError(f"served kind {kind.name!r} is registered already")
    _KINDS.append(kind)


def kinds(per: str | None = None) -> tuple[ServedKind, ...]:
    """The registered kinds in order; `per`: only the "picture" or only the "instance" ones."""
    return tuple(k for k in _KINDS if per is None or k.per == per)


def fields_for(per: str) -> tuple[ServedKind, ...]:
    """The kinds whose fields the dataclass for `per` gets (d2export/instances.py); the registry is closed from then."""
    global _sealed
    _sealed = True
    return kinds(per)


for _module in MODULES:
    for _kind in _module.KINDS:
        register(_kind)
