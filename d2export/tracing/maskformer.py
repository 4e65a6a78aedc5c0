"""The tracing side of Mask2Former-style segmenters (MaskFormer meta-architecture: backbone, a `sem_seg_head` with a
pixel decoder and a masked-attention transformer decoder), whose `forward` pads with `ImageList.from_tensors` (a
`.item()` per image) and post-processes each picture in Python loops that no graph holds.

`MaskFormerAdapter.forward` runs the model's own backbone and `sem_seg_head` on a batch normalised and zero-padded
in the graph to the model's `size_divisibility`, and returns what the head returns: per-query class logits and mask
logits at a quarter of the padded size. `reference` is independent of it: the model's own forward on list[dict],
with the head's outputs captured as the model hands them to its post-processing.

With `export.postprocess=graph` the graph also holds each task's results (d2export/tracing/mask_results.py): their
reference outputs are that same work on the head's captured outputs (what the graph is compared with, tensor by
tensor, its near-ties pinned), and what serving makes of them (d2export/families/_mask_predictions.py
`graph_prediction`) is held to what the model's own `semantic_inference`, `panoptic_inference` and
`instance_inference` returned inside that forward (`own_results`; d2export/verification/served_masks.py): a wrong
rule in the traced code refuses the export instead of passing as its own reference.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from d2export.tracing import mask_results
from d2export.tracing.detr import DetrAdapter

OUTPUT_NAMES = ("pred_logits", "pred_masks")


class MaskFormerAdapter(DetrAdapter):
    """`task`: for task-conditioned heads (OneFormer: `task_mlp` over the tokenised prompt "The task is <task>",
    handed to the head beside the features), the task the graph is made for; the tokens are a constant of the graph.
    `boxes`: the head also returns `pred_boxes` (MaskDINO), a third output. `post`: the post-processing's settings
    (the manifest's postprocess section), with `results` (output name → its dynamic axes, as the family serves
    them): each task's results computed in the graph too (d2export/tracing/mask_results.py,
    export.postprocess=graph). Inputs, normalisation and zeroing past each image are DetrAdapter's."""

    batchable = True  # the model masks no padding: a batch is exact as the model's own forward pads it

    def __init__(self, model: nn.Module, pixel_mean: Sequence[float], pixel_std: Sequence[float],
                 task: str | None = None, boxes: bool = False, post: dict | None = None,
                 results: dict[str, dict[int, str]] | None = None):
        names = OUTPUT_NAMES + (("pred_boxes",) if boxes else ())
        super().__init__(model, "sem_seg_head", None, names + tuple(results or ()), pixel_mean, pixel_std)
        self.head_outputs, self.post, self.results_axes = names, post, dict(results or {})
        self.divisibility = int(model.size_divisibility) or 1
        self.prompt = None if task is None else f"The task is {task}"  # OneFormer's dataset mappers' words
        if self.prompt is not None:
            self.register_buffer("task_tokens", model.task_tokenizer(self.prompt).float()[None], False)
        self.own_results = None  # what the model's own forward returned in the last `reference` call

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = super().dynamic_axes | {"pred_masks": {0: "batch", 2: "mask_height", 3: "mask_width"}}
        return axes | self.results_axes

    def forward(self, images: Tensor, image_sizes: Tensor) -> tuple[Tensor, ...]:
        x = self.normalised(images, image_sizes)
        d = self.divisibility  # then up to a multiple of size_divisibility, as ImageList pads
        x = F.pad(x, [0, (d - x.shape[3] % d) % d, 0, (d - x.shape[2] % d) % d])
        features = self.model.backbone(x.contiguous())
        if self.prompt is None:
            out = self.head(features)
        else:
            out = self.head(features, self.model.task_mlp(self.task_tokens).expand(x.shape[0], -1))
        return self._named(_outputs(out), image_sizes)

    def _named(self, head: dict, image_sizes: Tensor) -> tuple[Tensor, ...]:
        found = {name: head[name] for name in self.head_outputs}
        if self.post:
            found |= mask_results.results(head["pred_logits"], head["pred_masks"], image_sizes, self.post)
        return tuple(found[name] for name in self.output_names)

    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The head's outputs inside the model's own forward on list[dict] (its normalisation and ImageList)."""
        seen = []
        hook = self.head.register_forward_hook(lambda m, args, out: seen.append(_outputs(out)))
        task = {} if self.prompt is None else {"task": self.prompt}
        try:
            own = self.model([{"image": torch.from_numpy(np.ascontiguousarray(im)).float()} | task for im in images])
        finally:
            hook.remove()
        sizes = torch.tensor([im.shape[-2:] for im in images], dtype=torch.int64)
        self.own_results = own  # its own inference's results: what served results are held to
        return [t.cpu().numpy() for t in self._named(seen[-1], sizes.to(seen[-1]["pred_logits"].device))]


def _outputs(out) -> dict:
    """The head's output dict; MaskDINO's head returns (outputs, denoising record)."""
    return out[0] if isinstance(out, tuple) else out
