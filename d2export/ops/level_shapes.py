"""Feature-level sizes that stay symbolic through a trace.

Deformable-attention code carries level sizes in a `spatial_shapes` tensor built from the feature maps' shapes.
Reading them back out of that tensor is fine for the TorchScript tracer (the values are traced) but, under
torch.export, every read is a data-dependent value that export refuses to branch, slice or allocate on. So where
d2export builds `spatial_shapes` from traced sizes it also remembers those sizes on the tensor, and everything that
needs a level's (H, W) asks `level_shapes` first: traced 0-d tensors for the TorchScript tracer, SymInts for
torch.export, ints eagerly.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

_ATTR = "_d2export_level_shapes"


def is_size(x) -> bool:
    """A size read from a traced shape: a 0-d tensor (TorchScript tracer) or a SymInt (torch.export)."""
    return isinstance(x, (Tensor, torch.SymInt))


def holds_size(data) -> bool:
    return any(is_size(x) or isinstance(x, (list, tuple)) and holds_size(x) for x in data)


def size_tensor(x) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(torch.long)
    # scalar_tensor keeps a SymInt symbolic where as_tensor would specialise it to the dummy's value
    return torch.scalar_tensor(x, dtype=torch.long)


def stack_sizes(data) -> Tensor:
    """`torch.as_tensor([(h, w), …])` for traced sizes: stacked, so they stay in the graph."""
    if isinstance(data, (list, tuple)):
        return torch.stack([stack_sizes(x) for x in data])
    return size_tensor(data)


def remember(spatial_shapes: Tensor, shapes) -> Tensor:
    setattr(spatial_shapes, _ATTR, [tuple(s) for s in shapes])
    return spatial_shapes


def level_shapes(spatial_shapes: Tensor) -> list[tuple]:
    """[(H, W), …] per level: the remembered sizes when there are some, else read from the tensor (0-d tensors
    while tracing, ints eagerly)."""
    known = getattr(spatial_shapes, _ATTR, None)
    if known is not None:
        return known
    if torch.jit.is_tracing():
        return [tuple(level.unbind(0)) for level in spatial_shapes.unbind(0)]
    return [tuple(level) for level in spatial_shapes.tolist()]


def level_starts(shapes) -> list:
    """Start of each level in the flattened tokens, from the sizes (no read of level_start_index)."""
    starts, total = [], 0
    for h, w in shapes:
        starts.append(total)
        total = total + h * w
    return starts


def static_size(x) -> int:
    """A traced size that is part of the model's structure (the same at every input size, e.g. a coordinate count)
    as a Python int, without the TracerWarning that would otherwise flag it as a baked value."""
    if isinstance(x, Tensor):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return int(x)
    return x


def size_hint(x) -> int:
    """A traced size's value at this trace (TorchScript's 0-d tensor, torch.export's SymInt: its example value, no
    guard added), for a decision that holds at every size and so is not baked into the graph."""
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return optimization_hint(x)
    return static_size(x)
