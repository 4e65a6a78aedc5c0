"""Any other detectron2 meta-architecture (R-CNN, RetinaNet, …) through detectron2's own TracingAdapter.

Input `image` [3, H, W] float in the model's pixel format, one image; outputs are the fields of the raw (not
rescaled) Instances in sorted order, then `image_size`. Counts are data-dependent, so the dummy image must yield at
least one detection (a trace on zero detections builds a graph that fails on 0-row tensors).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn


def _inference(model, inputs):
    instances = model.inference(inputs, do_postprocess=False)[0]
    return [{"instances": instances}]


class RCNNAdapter(nn.Module):
    batchable = False  # one image per call: the graph's input is [3, H, W]

    def __init__(self, model: nn.Module, example: np.ndarray):
        from detectron2.export import TracingAdapter

        super().__init__()
        self.model = model
        image = torch.from_numpy(np.ascontiguousarray(example)).float()
        self.inner = TracingAdapter(model, [{"image": image}], _inference)
        with torch.no_grad():
            instances = _inference(model.eval(), [{"image": image}])[0]["instances"]
        if len(instances) == 0:
            raise ValueError("the dummy input yields no detections, and a trace on zero detections is broken at run "
                             "time: lower the model's test score threshold for export or use another dummy size")
        self._outputs = tuple(_field_name(k) for k in sorted(instances.get_fields())) + ("image_size",)

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("image",)

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {"image": {1: "height", 2: "width"}}
        axes.update({name: {0: "detections"} for name in self._outputs[:-1]})
        return axes

    def graph_inputs(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        if len(images) != 1:
            raise ValueError("the R-CNN export takes one image at a time")
        return {"image": images[0].astype(np.float32)}

    def forward(self, image):
        return self.inner(image)

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(images) != 1:
            raise ValueError("the R-CNN export takes one image at a time")
        image = torch.from_numpy(np.ascontiguousarray(images[0])).float()
        return [t.numpy() for t in self.inner(image)]


def _field_name(key: str) -> str:
    return key[len("pred_"):] if key.startswith("pred_") else key
