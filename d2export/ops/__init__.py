"""Traceable replacements for export-hostile ops. Names resolve lazily: importing the package imports no torch.

- `msda`: multi-scale deformable attention core (`multi_scale_deformable_attention`, `SAMPLERS`, `use_sampler`).
- `grid_sample`: `bilinear_grid_sample`, F.grid_sample without a GridSample node.
"""
import importlib

_EXPORTS = {
    "multi_scale_deformable_attention": "msda",
    "use_sampler": "msda",
    "bilinear_grid_sample": "grid_sample",
}
__all__ = sorted(_EXPORTS) + ["SAMPLERS"]
# `msda`'s samplers, named here so that checking a config imports no torch
SAMPLERS = ("auto", "gather", "grid_sample", "pytorch", "trt_plugin", "fused")


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
