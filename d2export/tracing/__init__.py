"""Between detectron2's list[dict] → list[{"instances": Instances}] interface and the flat tensors a graph needs."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from torch import nn

from d2export.imaging import pad_batch, synthetic_image


def detect_family(model: nn.Module) -> str:
    from d2export.tracing.text_spotter import is_text_spotter

    return "text_spotter" if is_text_spotter(model) else "rcnn"


def dummy_images(sizes: Sequence[Sequence[int]], seed: int = 0) -> list[np.ndarray]:
    return [synthetic_image(int(h), int(w), seed + i) for i, (h, w) in enumerate(sizes)]


def make_adapter(model: nn.Module, d2cfg, family: str, example: Sequence[np.ndarray], text_logits: bool = False):
    if family == "auto":
        family = detect_family(model)
    if family == "text_spotter":
        from d2export.tracing.text_spotter import TextSpotterAdapter

        return TextSpotterAdapter(model, d2cfg.MODEL.PIXEL_MEAN, d2cfg.MODEL.PIXEL_STD, text_logits)
    if family == "rcnn":
        from d2export.tracing.rcnn import RCNNAdapter

        return RCNNAdapter(model, example[0])
    raise ValueError(f"model.family={family!r}: choose auto, text_spotter or rcnn")


def graph_inputs(adapter: nn.Module, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """CHW uint8 images → the adapter's named graph inputs."""
    if adapter.family == "rcnn":
        if len(images) != 1:
            raise ValueError("the R-CNN export takes one image at a time")
        return {"image": images[0].astype(np.float32)}
    batch, sizes = pad_batch(images)
    return {"images": batch, "image_sizes": sizes}


def torch_inputs(adapter: nn.Module, images: Sequence[np.ndarray]) -> tuple:
    """CHW uint8 images → the adapter's positional tensor inputs, for tracing or an eager call."""
    import torch

    named = graph_inputs(adapter, images)
    return tuple(torch.from_numpy(named[n]) for n in adapter.input_names)
