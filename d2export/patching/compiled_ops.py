"""Load-time stand-ins for compiled MSDA extensions (`adet._C`, `MultiScaleDeformableAttention`, …).

Research code imports its CUDA extension at module import (`from adet import _C`). Where that extension was never
built, or was built without a CPU kernel, the user's model cannot even be imported on a CPU machine. A meta-path
finder placed *after* the real ones answers for the configured names only when nothing else does, with a module whose
`ms_deform_attn_forward` / `ms_deform_attn_backward` run d2export's pure-PyTorch core, and whose `dcnv3_forward` /
`dcnv3_backward` run its DCNv3 (detrex's `_C` holds both ops; InternImage backbones call the second).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
import weakref
from typing import Iterable

import torch
import torch.utils.weak

log = logging.getLogger(__name__)


# A forward whose inputs will be differentiated keeps its autograd graph here, keyed (weakly) by its
# sampling-locations tensor, which the caller's autograd.Function saves and hands back to the backward: the backward
# then differentiates that graph instead of running the forward a second time (where the other two inputs are the
# forward's too; otherwise it runs the forward again, as it always may).
_graphs = torch.utils.weak.WeakIdKeyDictionary()


def _core(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    from d2export.ops.msda import multi_scale_deformable_attention

    return multi_scale_deformable_attention(value, spatial_shapes, level_start_index, sampling_locations,
                                            attention_weights)


def _with_graph(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """(detached leaves, output with its graph)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (value, sampling_locations, attention_weights)]
        return leaves, _core(leaves[0], spatial_shapes, level_start_index, leaves[1], leaves[2])


def ms_deform_attn_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                           im2col_step=64):
    # inside the caller's autograd.Function grad mode is off, but inputs that will be differentiated say so
    if not any(t.requires_grad for t in (value, sampling_locations, attention_weights)):
        return _core(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    leaves, out = _with_graph(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    _graphs[sampling_locations] = (weakref.ref(value), weakref.ref(attention_weights), leaves, out)
    return out.detach()


def ms_deform_attn_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            grad_output, im2col_step=64):
    """The compiled op's backward contract: (grad_value, grad_sampling_locations, grad_attention_weights)."""
    kept = _graphs.pop(sampling_locations, None)
    if kept and kept[0]() is value and kept[1]() is attention_weights:
        leaves, out = kept[2:]
    else:
        leaves, out = _with_graph(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return torch.autograd.grad(out, leaves, grad_output, allow_unused=True)


def dcnv3_forward(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                  group, group_channels, offset_scale, im2col_step):
    """The compiled DCNv3 op's forward contract (im2col_step only splits the CUDA op's work)."""
    from d2export.ops.dcnv3 import dcnv3

    return dcnv3(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                 group, group_channels, offset_scale)


def dcnv3_backward(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                   group, group_channels, offset_scale, grad_output, im2col_step):
    """The compiled DCNv3 op's backward contract: (grad_input, grad_offset, grad_mask), by differentiating the
    forward again."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (input, offset, mask)]
        out = dcnv3_forward(*leaves, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                            group, group_channels, offset_scale, im2col_step)
        return torch.autograd.grad(out, leaves, grad_output, allow_unused=True)


# Modules that research code imports at module level for something the exported model never runs: detectron2's `_C`
# (`mask2former/__init__` imports its COCO evaluator, whose `fast_eval_api` imports it), OneFormer's `natten` (the
# DiNAT backbone; no wheel for most platforms) and `wandb` (training logs). Their stand-ins make imports succeed:
# any name imported from them is a placeholder that says what is missing when called.
IMPORT_ONLY_WHY = {
    "detectron2._C": "detectron2 was installed without its compiled ops (_C)",
    "natten": "natten is not installed: DiNAT's neighbourhood attention is natten's compiled op, which d2export has "
              "no traceable form of; export the model's Swin or ConvNeXt config instead",
}
_import_only: set[str] = set()


def _placeholder(name: str, why: str):
    class Missing:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"{name}: {why}; d2export stands in for it only so that imports succeed")

        def __init_subclass__(cls, **kwargs):  # a class of the checkout's deriving from it is fine until built
            pass

    Missing.__name__ = Missing.__qualname__ = name.rpartition(".")[2]
    return Missing


def _import_only_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"d2export stand-in for {name!r}: importable, nothing in it works")
    module.__path__ = []  # a package: its submodules may be stood in for too
    why = IMPORT_ONLY_WHY.get(name, f"{name} is not installed")

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{name}.{attr}", why)

    module.__getattr__ = __getattr__
    return module


def make_stand_in(name: str) -> types.ModuleType:
    if name in _import_only or name in IMPORT_ONLY_WHY:
        module = _import_only_module(name)
    else:
        module = types.ModuleType(name, f"d2export stand-in for the compiled MSDA extension {name!r}")
        module.ms_deform_attn_forward = ms_deform_attn_forward
        module.ms_deform_attn_backward = ms_deform_attn_backward
        module.dcnv3_forward = dcnv3_forward  # detrex's and InternImage's DCNv3 share the extension's namespace
        module.dcnv3_backward = dcnv3_backward
    module.__d2export_stand_in__ = True
    return module


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return make_stand_in(spec.name)

    def exec_module(self, module):
        if module.__name__ in _import_only or module.__name__ in IMPORT_ONLY_WHY:
            log.info("module %s not found: a stand-in lets it import (nothing in it works)", module.__name__)
        else:
            log.info("compiled MSDA extension %s not found: using d2export's pure-PyTorch core", module.__name__)


class CompiledOpFinder(importlib.abc.MetaPathFinder):
    """Answers for `names` only; sits at the end of sys.meta_path, so a real build always wins."""

    def __init__(self, names: Iterable[str]):
        self.names = set(names)
        self.served: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        self.served.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader())


_finder: CompiledOpFinder | None = None


def install(names: Iterable[str], import_only: Iterable[str] = ()) -> CompiledOpFinder:
    """Install (or extend) the process-wide finder for compiled MSDA extensions (`names`) and modules imported but
    never used (`import_only`; see IMPORT_ONLY_WHY). Idempotent."""
    global _finder
    import_only = [n for n in import_only if n not in names]
    _import_only.update(import_only)
    names = list(names) + import_only
    if "detectron2._C" in names:
        # detectron2's COCO evaluator picks its fast implementation where `fast_eval_api` imports; bound before the
        # stand-in exists, it keeps the plain one, which runs without `_C`
        with contextlib.suppress(ImportError):
            importlib.import_module("detectron2.evaluation.coco_evaluation")
    if _finder is None or _finder not in sys.meta_path:
        _finder = CompiledOpFinder(names)
        sys.meta_path.append(_finder)
    else:
        _finder.names.update(names)
    return _finder


def uninstall() -> None:
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
        for name in _finder.served:
            mod = sys.modules.get(name)
            if getattr(mod, "__d2export_stand_in__", False):
                del sys.modules[name]
    _finder = None
    _import_only.clear()
