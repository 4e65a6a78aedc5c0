"""The tracing wrapper for DETR-style detectors on detectron2: flat tensors in, flat fixed-K tensors out.

Inputs
- `images` [N, 3, H, W]: uint8 (or float) pixels in the model's pixel format (cfg.INPUT.FORMAT), each image at the
  top-left of the batch, zero beyond its own size;
- `image_sizes` [N, 2] int64: each image's true (height, width) inside the batch.
Normalisation and zero padding happen in the graph, and the model's padding masks are computed from `image_sizes`,
so a batch of mixed sizes is right. The head's raw output dict becomes flat tensors through the family's `decode`
(K = the model's number of queries or its top-K; thresholding stays on the host).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from d2export.resizing import pad_batch

INPUT_NAMES = ("images", "image_sizes")


class ImageBatch:
    """What a DETR head's backbone wrapper reads from detectron2's ImageList: `.tensor` and `.image_sizes`."""

    def __init__(self, tensor: Tensor, image_sizes: Tensor):
        self.tensor = tensor
        self.image_sizes = image_sizes

    def __len__(self) -> int:
        return self.tensor.shape[0]


class DetrAdapter(nn.Module):
    """`head(image_list)` → dict of raw outputs → `decode(raw, image_sizes)` → flat tensors. `head`: the name of the
    model's child that takes an ImageList, or a module doing that job for models whose forward has no such part."""

    batchable = True  # mixed-size batches are exact: padding masks come from image_sizes

    def __init__(self, model: nn.Module, head: str | nn.Module, decode: Callable[[dict, Tensor], tuple],
                 output_names: Sequence[str], pixel_mean: Sequence[float], pixel_std: Sequence[float]):
        super().__init__()
        self.model = model
        self.head = getattr(model, head) if isinstance(head, str) else head
        self.decode = decode
        self._output_names = tuple(output_names)
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean, dtype=torch.float32).view(1, -1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(pixel_std, dtype=torch.float32).view(1, -1, 1, 1), False)

    @property
    def input_names(self) -> tuple[str, ...]:
        return INPUT_NAMES

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._output_names

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {"images": {0: "batch", 2: "height", 3: "width"}, "image_sizes": {0: "batch"}}
        axes.update({name: {0: "batch"} for name in self.output_names})
        return axes

    def graph_inputs(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        batch, sizes = pad_batch(images)
        return {"images": batch, "image_sizes": sizes}

    def normalised(self, images: Tensor, image_sizes: Tensor) -> Tensor:
        """The batch normalised and zero beyond each image, as detectron2's ImageList pads after normalising."""
        x = (images.float() - self.pixel_mean) / self.pixel_std
        rows = torch.arange(x.shape[2], device=x.device)[None, :, None] < image_sizes[:, 0, None, None]
        cols = torch.arange(x.shape[3], device=x.device)[None, None, :] < image_sizes[:, 1, None, None]
        return x * (rows & cols)[:, None].to(x.dtype)

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        x = self.normalised(images, image_sizes)
        return self.decode(self.head(ImageBatch(x.contiguous(), image_sizes)), image_sizes)

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Eager outputs through the model's own code path (its preprocess_image and ImageList padding)."""
        batch = [{"image": torch.from_numpy(np.ascontiguousarray(im)).float()} for im in images]
        image_list = self.model.preprocess_image(batch)
        out = self.head(image_list)
        sizes = torch.tensor([list(s) for s in image_list.image_sizes], device=image_list.tensor.device)
        return [t.cpu().numpy() for t in self.decode(out, sizes)]
