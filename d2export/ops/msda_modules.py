"""Which modules are multi-scale deformable attention: recognised by what they have (four projections and
head/level/point counts), not by their class name, and which of the field's two call conventions they follow.
Families, the MSDA swap and the parity ladder all ask here."""
from __future__ import annotations

from torch import nn

_PROJECTIONS = ("sampling_offsets", "attention_weights", "value_proj", "output_proj")


def counts(module: nn.Module) -> tuple[int, int, int] | None:
    heads = getattr(module, "n_heads", getattr(module, "num_heads", None))
    levels = getattr(module, "n_levels", getattr(module, "num_levels", None))
    points = getattr(module, "n_points", getattr(module, "num_points", None))
    if all(isinstance(v, int) for v in (heads, levels, points)):
        return heads, levels, points
    return None


def is_msda(module: nn.Module) -> bool:
    """Duck typing: the four projections plus head/level/point counts make an MSDA, whatever its class name."""
    return all(isinstance(getattr(module, p, None), nn.Linear) for p in _PROJECTIONS) and counts(module) is not None


def convention(module: nn.Module) -> str:
    return "mmcv" if hasattr(module, "batch_first") or hasattr(module, "num_heads") else "deformable_detr"
