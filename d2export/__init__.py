"""d2export: detectron2 detectors with deformable attention, exported to ONNX and served.

This module stays light: `import d2export` (and `import d2export.runtime`) must not import torch or detectron2,
so a serving image needs only onnxruntime, numpy and Pillow. The names below load on first use.

    import d2export
    d2export.activate()             # compiled MSDA extensions that are missing resolve to the pure-PyTorch core
    import adet.modeling            # unedited user code now imports on a CPU-only machine
    model = build_model(cfg)
    d2export.swap_msda(model)       # every MSDA module runs the traceable core (eager use, fine-tuning)
    d2export.export(d2export.load_config("textdet", ["model.weights=model.pth"]))
"""
__version__ = "0.1.0"

DEFAULT_COMPILED_OPS = ("adet._C", "detrex._C", "MultiScaleDeformableAttention")

from d2export import moved as _moved  # noqa: E402 - old module names answer with the new modules, warning

_moved.install()


def activate(compiled_ops=DEFAULT_COMPILED_OPS):
    """Install the load-time import hook for these compiled MSDA extension module names (idempotent)."""
    from d2export.patching import compiled_ops as hook

    return hook.install(compiled_ops)


def __getattr__(name):
    lazy = {
        "swap_msda": ("d2export.patching.msda_swap", "swap"),
        "export": ("d2export.pipeline", "export"),
        "load_config": ("d2export.config", "load"),
        "multi_scale_deformable_attention": ("d2export.ops.msda", "multi_scale_deformable_attention"),
        "register_patch": ("d2export.patching", "register_patch"),
        "apply_patches": ("d2export.patching", "apply_patches"),
    }
    if name not in lazy:
        raise AttributeError(f"module 'd2export' has no attribute {name!r}")
    import importlib

    module, attr = lazy[name]
    return getattr(importlib.import_module(module), attr)
