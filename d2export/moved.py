"""Modules that moved in the 0.2 layout, still importable under their old names with a DeprecationWarning: scripts
and Triton model folders written against the old paths keep working while they are updated. The old name resolves
to the very module object of the new one (one module, two names; no copy)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {  # old dotted name → where it lives now
    "d2export.runtime.custom_ops": "d2export.kernels.custom_ops",
    "d2export.runtime.native_build": "d2export.kernels.native_build",
    "d2export.runtime.cuda_build": "d2export.kernels.cuda_build",
    "d2export.runtime.msda_kernel": "d2export.kernels.numba_msda",
    "d2export.runtime.session_cache": "d2export.runtime.optimized_cache",
    "d2export.runtime.images": "d2export.runtime.image_decoding",
    "d2export.imaging": "d2export.resizing",
    "d2export.commandline": "d2export.argparsing",
    "d2export.stages": "d2export.stage_errors",
    "d2export.compare": "d2export.side_by_side",
    "d2export.exporting.verify": "d2export.verification.comparison",
    "d2export.exporting.ladder": "d2export.verification.ladder",
    "d2export.exporting.near_ties": "d2export.verification.near_ties",
    "d2export.exporting.pinning": "d2export.verification.pinning",
    "d2export.exporting.served_text": "d2export.verification.served_text",
    "d2export.exporting.served_masks": "d2export.verification.served_masks",
    "d2export.exporting.host_copies": "d2export.verification.host_copies",
    "d2export.exporting.sessions": "d2export.verification.check_sessions",
    "d2export.exporting.pictures": "d2export.verification.pictures",
    "d2export.ops.rewrites": "d2export.ops.tensor_ops",
    "d2export.patching.rewrites": "d2export.patching.operator_patches",
    "d2export.patching.family": "d2export.patching.deformable_attention",
    "d2export.patching.adet_family": "d2export.ops.detr_sizes",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module):
        sys.modules[module.__spec__.name] = module  # the old name keeps answering with the new module


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old name, warns once per import, and hands back the new module."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old name will go in a later release", DeprecationWarning,
                      stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())  # last: a real module of that name, if one exists, wins
