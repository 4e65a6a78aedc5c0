"""Between detectron2's list[dict] → list[{"instances": Instances}] interface and the flat tensors a graph needs.

Adapters (built by each model family, d2export/families) share one interface: `input_names`, `output_names`,
`dynamic_axes`, `batchable`, `graph_inputs(images)` (CHW uint8 images → named numpy inputs), `forward(*tensors)`
and `reference(images)` (eager outputs through the model's own code path).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from torch import nn

from d2export.resizing import synthetic_image


def dummy_images(sizes: Sequence[Sequence[int]], seed: int = 0) -> list[np.ndarray]:
    return [synthetic_image(int(h), int(w), seed + i) for i, (h, w) in enumerate(sizes)]


def graph_inputs(adapter: nn.Module, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """CHW uint8 images → the adapter's named graph inputs."""
    return adapter.graph_inputs(images)


def torch_inputs(adapter: nn.Module, images: Sequence[np.ndarray]) -> tuple:
    """CHW uint8 images → the adapter's positional tensor inputs, for tracing or an eager call, on its device."""
    import torch

    named = graph_inputs(adapter, images)
    device = next(adapter.parameters(), torch.empty(0)).device
    return tuple(torch.from_numpy(named[n]).to(device) for n in adapter.input_names)
