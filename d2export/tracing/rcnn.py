"""The tracing wrapper for detectron2's own detectors (GeneralizedRCNN, RetinaNet, PanopticFPN): the model's raw
inference (before detector_postprocess) as flat tensors, one image per run.

Inputs
- `images` [1, 3, H, W]: uint8 pixels in the model's pixel format (cfg.INPUT.FORMAT);
- `image_sizes` [1, 2] int64: the image's true (height, width) inside `images` (padding beyond it is cropped away).
Batch is fixed at one: detectron2 loops over a batch's images in Python (proposals, ROI pooling, NMS), which a trace
unrolls, so a graph traced on N images would only ever take N.

Outputs [1, R, …] with R the detections found (data-dependent), in input-image pixels: `boxes` [1, R, 4] xyxy,
`scores`, `labels`, and where the model has them `masks` [1, R, M, M] (per-box probabilities, pasted on the host) and
`keypoints` [1, R, K, 3] (x, y, score); other tensors a family's `infer` returns (e.g. `sem_seg`) follow.

Inside the adapter (tracing, references) the model runs with its test score threshold at 0 (the graph returns
everything the detector keeps, thresholding on the host: the same detections above the model's own threshold, since
NMS and top-k never let a low score displace a higher one) — so a random-weight model still traces on detections.
Outside it, the model keeps its own thresholds: called as the user calls it, it answers as before.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

INPUT_NAMES = ("images", "image_sizes")
FIELDS = {"pred_boxes": "boxes", "scores": "scores", "pred_classes": "labels", "pred_masks": "masks",
          "pred_keypoints": "keypoints"}

Infer = Callable[[nn.Module, list], dict]  # (model, [{"image": float CHW}]) → output name → tensor (no batch dim)


def instance_tensors(instances) -> dict[str, Tensor]:
    """detectron2 Instances → the graph's per-image outputs (the fields it has, in FIELDS order)."""
    out = {}
    for field, name in FIELDS.items():
        if instances.has(field):
            value = instances.get(field)
            value = value.tensor if hasattr(value, "tensor") else value
            out[name] = value[:, 0] if field == "pred_masks" else value
    return out


def rcnn_inference(model: nn.Module, inputs: list) -> dict[str, Tensor]:
    """GeneralizedRCNN (Faster/Mask/Keypoint R-CNN): its own inference, without detector_postprocess."""
    return instance_tensors(model.inference(inputs, do_postprocess=False)[0])


class RCNNAdapter(nn.Module):
    batchable = False  # see the module docstring: detectron2 unrolls the batch

    def __init__(self, model: nn.Module, example: np.ndarray, infer: Infer = rcnn_inference,
                 axes: dict[str, dict[int, str]] | None = None):
        """`axes`: dynamic axes of outputs that are not per detection (e.g. a semantic map's height and width)."""
        super().__init__()
        self.model = model
        self.infer = infer
        self.axes = dict(axes or {})
        with torch.no_grad():
            out = self._infer(model.eval(), torch.from_numpy(np.ascontiguousarray(example)).float())
        if len(out["scores"]) == 0:
            raise ValueError("the dummy input yields no detections even at score threshold 0, and a trace on zero "
                             "detections is broken at run time: use another dummy size")
        self._outputs = tuple(out)

    @property
    def input_names(self) -> tuple[str, ...]:
        return INPUT_NAMES

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {"images": {2: "height", 3: "width"}}
        axes.update({name: self.axes.get(name, {1: "detections"}) for name in self._outputs})
        return axes

    def graph_inputs(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        _one(images)
        image = np.ascontiguousarray(images[0])
        return {"images": image[None], "image_sizes": np.array([image.shape[1:]], dtype=np.int64)}

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        if torch.compiler.is_exporting():  # torch.export: the image is taken whole, its size said by image_sizes
            image = images[0].float()  # (a crop to sizes read from data would be data-dependent)
            torch._check(image_sizes[0, 0].item() == image.shape[1])
            torch._check(image_sizes[0, 1].item() == image.shape[2])
        else:
            image = images[0, :, : image_sizes[0, 0], : image_sizes[0, 1]].float()
        out = self._infer(self.model, image)
        return tuple(out[name][None] for name in self._outputs)

    def _infer(self, model: nn.Module, image: Tensor) -> dict[str, Tensor]:
        with score_thresholds_at_zero(model):
            return self.infer(model, [{"image": image}])

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Eager outputs through the model's own code path."""
        _one(images)
        out = self._infer(self.model, torch.from_numpy(np.ascontiguousarray(images[0])).float())
        return [out[name][None].cpu().numpy() for name in self._outputs]


def _one(images: Sequence[np.ndarray]) -> None:
    if len(images) != 1:
        raise ValueError(f"detectron2's own detectors export for one image per run (got {len(images)}): "
                         "detectron2 loops over a batch in Python, which a trace would bake in")


@contextlib.contextmanager
def score_thresholds_at_zero(model: nn.Module) -> Iterator[None]:
    """Every test score threshold of a built detectron2 detector at 0 for the duration (see the module docstring)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "test_score_thresh", None), float)]
    saved = [m.test_score_thresh for m in found]
    for m in found:
        m.test_score_thresh = 0.0
    try:
        yield
    finally:
        for m, value in zip(found, saved):
            m.test_score_thresh = value
