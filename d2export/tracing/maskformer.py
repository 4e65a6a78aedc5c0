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

from d2export.imaging import pad_batch
from d2export.tracing.detr import INPUT_NAMES

OUTPUT_NAMES = ("pred_logits", "pred_masks")


class MaskFormerAdapter(nn.Module):
    """`task`: for task-conditioned heads (OneFormer: `task_mlp` over the tokenised prompt "The task is <task>",
    handed to the head beside the features), the task the graph is made for; the tokens are a constant of the graph.
    `boxes`: the head also returns `pred_boxes` (MaskDINO), a third output."""

    batchable = True  # the model masks no padding: a batch is exact as the model's own forward pads it

    def __init__(self, model: nn.Module, pixel_mean: Sequence[float], pixel_std: Sequence[float],
                 task: str | None = None, boxes: bool = False):
        super().__init__()
        self.model = model
        self.divisibility = int(model.size_divisibility) or 1
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean, dtype=torch.float32).view(1, -1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(pixel_std, dtype=torch.float32).view(1, -1, 1, 1), False)
        self.prompt = None if task is None else f"The task is {task}"  # OneFormer's dataset mappers' words
        if self.prompt is not None:
            self.register_buffer("task_tokens", model.task_tokenizer(self.prompt).float()[None], False)
        self.output_names = OUTPUT_NAMES + (("pred_boxes",) if boxes else ())

    input_names = INPUT_NAMES

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {"images": {0: "batch", 2: "height", 3: "width"}, "image_sizes": {0: "batch"},
                "pred_masks": {0: "batch", 2: "mask_height", 3: "mask_width"},
                **{name: {0: "batch"} for name in self.output_names if name != "pred_masks"}}

    def graph_inputs(self, images: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        batch, sizes = pad_batch(images)
        return {"images": batch, "image_sizes": sizes}

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        # zero beyond each image (ImageList pads after normalising), then up to a multiple of size_divisibility
        rows = torch.arange(x.shape[2], device=x.device)[None, :, None] < image_sizes[:, 0, None, None]
        cols = torch.arange(x.shape[3], device=x.device)[None, None, :] < image_sizes[:, 1, None, None]
        x = x * (rows & cols)[:, None].to(x.dtype)
        d = self.divisibility
        x = F.pad(x, [0, (d - x.shape[3] % d) % d, 0, (d - x.shape[2] % d) % d])
        features = self.model.backbone(x.contiguous())
        if self.prompt is None:
            out = self.model.sem_seg_head(features)
        else:
            out = self.model.sem_seg_head(features, self.model.task_mlp(self.task_tokens).expand(x.shape[0], -1))
        return tuple(_outputs(out)[name] for name in self.output_names)

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The head's outputs inside the model's own forward on list[dict] (its normalisation and ImageList)."""
        seen = []
        hook = self.model.sem_seg_head.register_forward_hook(lambda m, args, out: seen.append(_outputs(out)))
        task = {} if self.prompt is None else {"task": self.prompt}
        try:
            self.model([{"image": torch.from_numpy(np.ascontiguousarray(im)).float()} | task for im in images])
        finally:
            hook.remove()
        return [seen[-1][name].cpu().numpy() for name in self.output_names]


def _outputs(out) -> dict:
    """The head's output dict; MaskDINO's head returns (outputs, denoising record)."""
    return out[0] if isinstance(out, tuple) else out
