"""The tracing wrapper for DETR-style text spotters (TESTR lineage): flat tensors in, flat fixed-K tensors out.

Inputs
- `images` [N, 3, H, W]: uint8 (or float) pixels in the model's pixel format (cfg.INPUT.FORMAT), each image at the
  top-left of the batch, zero beyond its own size;
- `image_sizes` [N, 2] int64: each image's true (height, width) inside the batch.
Normalisation, padding masks and scaling of points to pixels happen in the graph, so a batch of mixed sizes is right.

Outputs (K = the model's number of queries; thresholding stays on the host)
- `scores` [N, K] float32: instance confidence (sigmoid of the mean control-point logit);
- `labels` [N, K] int64: class index (text spotters have one class: 0);
- `ctrl_points` [N, K, P, 2] float32: control points (x, y) in input-image pixels;
- `char_ids` [N, K, T] int64 and `char_scores` [N, K, T] float32: best character per slot and its probability
  (id == voc_size means "no character");
- `text_logits` [N, K, T, voc+1] float32, only with export.text_logits=true.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

INPUT_NAMES = ("images", "image_sizes")
OUTPUT_NAMES = ("scores", "labels", "ctrl_points", "char_ids", "char_scores")


class ImageBatch:
    """What the detector's backbone wrapper reads from detectron2's ImageList: `.tensor` and `.image_sizes`."""

    def __init__(self, tensor: Tensor, image_sizes: Tensor):
        self.tensor = tensor
        self.image_sizes = image_sizes

    def __len__(self) -> int:
        return self.tensor.shape[0]


def find_detr_head(model: nn.Module) -> tuple[str, nn.Module]:
    """The child that maps an image batch to `pred_logits`/`pred_ctrl_points`/`pred_texts` (TESTR's `testr`)."""
    for name, child in model.named_children():
        if hasattr(child, "backbone") and hasattr(child, "transformer") and hasattr(child, "text_class"):
            return name, child
    raise TypeError(f"{type(model).__name__} has no DETR-style text-spotting head (a child with backbone, "
                    "transformer and text_class): set model.family to another family")


def is_text_spotter(model: nn.Module) -> bool:
    try:
        find_detr_head(model)
        return True
    except TypeError:
        return False


def decode(out: dict, image_sizes: Tensor, text_logits: bool) -> tuple[Tensor, ...]:
    """The head's raw dict → flat outputs; the same arithmetic as TESTR's inference, minus thresholding."""
    scores, labels = out["pred_logits"].mean(-2).sigmoid().max(-1)
    wh = image_sizes.flip(-1).to(out["pred_ctrl_points"].dtype)[:, None, None, :]
    points = out["pred_ctrl_points"] * wh
    char_scores, char_ids = out["pred_texts"].softmax(-1).max(-1)
    flat = (scores, labels, points, char_ids, char_scores)
    return flat + (out["pred_texts"],) if text_logits else flat


class TextSpotterAdapter(nn.Module):
    family = "text_spotter"

    def __init__(self, model: nn.Module, pixel_mean: Sequence[float], pixel_std: Sequence[float],
                 text_logits: bool = False):
        super().__init__()
        self.model = model
        self.head_name, self.head = find_detr_head(model)
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean, dtype=torch.float32).view(1, -1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(pixel_std, dtype=torch.float32).view(1, -1, 1, 1), False)
        self.text_logits = text_logits

    @property
    def input_names(self) -> tuple[str, ...]:
        return INPUT_NAMES

    @property
    def output_names(self) -> tuple[str, ...]:
        return OUTPUT_NAMES + (("text_logits",) if self.text_logits else ())

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {"images": {0: "batch", 2: "height", 3: "width"}, "image_sizes": {0: "batch"}}
        axes.update({name: {0: "batch"} for name in self.output_names})
        return axes

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        # zero beyond each image, as detectron2's ImageList pads after normalising
        rows = torch.arange(x.shape[2], device=x.device)[None, :, None] < image_sizes[:, 0, None, None]
        cols = torch.arange(x.shape[3], device=x.device)[None, None, :] < image_sizes[:, 1, None, None]
        x = x * (rows & cols)[:, None].to(x.dtype)
        out = self.head(ImageBatch(x.contiguous(), image_sizes))
        return decode(out, image_sizes, self.text_logits)

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Eager outputs through the model's own code path (its preprocess_image and ImageList padding)."""
        batch = [{"image": torch.from_numpy(np.ascontiguousarray(im)).float()} for im in images]
        image_list = self.model.preprocess_image(batch)
        out = self.head(image_list)
        sizes = torch.tensor([list(s) for s in image_list.image_sizes], dtype=torch.long)
        return [t.numpy() for t in decode(out, sizes, self.text_logits)]
