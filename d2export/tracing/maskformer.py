"""The tracing side of Mask2Former-style segmenters (MaskFormer meta-architecture: backbone, a `sem_seg_head` with a
pixel decoder and a masked-attention transformer decoder), whose `forward` pads with `ImageList.from_tensors` (a
`.item()` per image) and post-processes each picture in Python loops that no graph holds.

`MaskFormerAdapter.forward` runs the model's own backbone and `sem_seg_head` on a batch normalised and zero-padded
in the graph to the model's `size_divisibility`, and returns what the head returns: per-query class logits and mask
logits at a quarter of the padded size. `reference` is independent of it: the model's own forward on list[dict],
with the head's outputs captured as the model hands them to its post-processing.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from d2export.tracing.detr import INPUT_NAMES
from d2export.imaging import pad_batch

OUTPUT_NAMES = ("pred_logits", "pred_masks")


class MaskFormerAdapter(nn.Module):
    batchable = True  # the model masks no padding: a batch is exact as the model's own forward pads it

    def __init__(self, model: nn.Module, pixel_mean: Sequence[float], pixel_std: Sequence[float]):
        super().__init__()
        self.model = model
        self.divisibility = int(model.size_divisibility) or 1
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean, dtype=torch.float32).view(1, -1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(pixel_std, dtype=torch.float32).view(1, -1, 1, 1), False)

    input_names = INPUT_NAMES
    output_names = OUTPUT_NAMES

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {"images": {0: "batch", 2: "height", 3: "width"}, "image_sizes": {0: "batch"},
                "pred_logits": {0: "batch"}, "pred_masks": {0: "batch", 2: "mask_height", 3: "mask_width"}}

    def graph_inputs(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        batch, sizes = pad_batch(images)
        return {"images": batch, "image_sizes": sizes}

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, Tensor]:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        # zero beyond each image (ImageList pads after normalising), then up to a multiple of size_divisibility
        rows = torch.arange(x.shape[2], device=x.device)[None, :, None] < image_sizes[:, 0, None, None]
        cols = torch.arange(x.shape[3], device=x.device)[None, None, :] < image_sizes[:, 1, None, None]
        x = x * (rows & cols)[:, None].to(x.dtype)
        d = self.divisibility
        x = F.pad(x, [0, (d - x.shape[3] % d) % d, 0, (d - x.shape[2] % d) % d])
        out = self.model.sem_seg_head(self.model.backbone(x.contiguous()))
        return out["pred_logits"], out["pred_masks"]

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The head's outputs inside the model's own forward on list[dict] (its normalisation and ImageList)."""
        seen = []
        hook = self.model.sem_seg_head.register_forward_hook(lambda m, args, out: seen.append(out))
        try:
            self.model([{"image": torch.from_numpy(np.ascontiguousarray(im)).float()} for im in images])
        finally:
            hook.remove()
        return [seen[-1][name].cpu().numpy() for name in OUTPUT_NAMES]
