"""Export-time patches: the registry (see registry.py) and the built-in operator rewrites registered on import."""
from d2export.patching.registry import (ALWAYS, Needs, PatchRecord, PatchRegistry, PatchReport, REGISTRY, Target,
                                        apply_patches, has_attrs, register_patch)
from d2export.patching import operator_patches as _rewrites  # noqa: E402,F401 - registers the built-in rewrites
from d2export.patching import deformable_attention as _family  # noqa: E402,F401 - registers the MSDA and model-family patches
from d2export.patching import zoo as _zoo  # noqa: E402,F401 - registers the detectron2 model-zoo patches
from d2export.patching import backbones as _backbones  # noqa: E402,F401 - registers the window-attention backbones'
from d2export.patching import masked_decoder as _masked_decoder  # noqa: E402,F401 - Mask2Former's masks per query

__all__ = ["ALWAYS", "Needs", "PatchRecord", "PatchRegistry", "PatchReport", "REGISTRY", "Target", "apply_patches",
           "has_attrs", "register_patch"]
