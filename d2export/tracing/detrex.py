"""The tracing side of detrex's DETR detectors (DeformableDETR, DINO, …), whose `forward` takes list[dict] and
builds padding masks in a per-image Python loop (a trace would bake the batch size and the dummy's image sizes).

`DetrexBody` runs the same flow from a padded batch and its `image_sizes` tensor: padding masks by the rule the
model's own forward is seen to follow (detrex's releases differ; `mask_rule` watches), the model's own backbone,
neck, position embedding and transformer, then the last decoder layer's class and box heads with the model module's
own `inverse_sigmoid`. `DetrexAdapter.reference` is independent of it: the model's own forward on list[dict], its
own `inference` top-k captured before `detector_postprocess`.
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from d2export.ops.level_shapes import static_size
from d2export.tracing.detr import DetrAdapter

# padding-mask rules of detrex's evaluation branch, in the order tried: rows/columns left unmasked short of each
# image's size (`img_masks[i, :(img_h - 1), :(img_w - 1)] = 0` on ones: 1; `:img_h`: 0), or None: no mask at all
# (`new_zeros`, releases before detrex#134)
MASK_RULES = (1, 0, None)
# a probe batch whose image sizes step by one pixel, so that at a stride up to 16 some image's last row and column
# fall on the rows and columns that nearest-neighbour resizing samples, and one image padded by more than a stride
PROBE_SIZES = [(64 - i, 80 - i) for i in range(16)] + [(32, 40)]


class _Seen(Exception):
    pass


def observed_mask(model: nn.Module) -> Tensor:
    """The first-level padding mask the model's own forward hands its position embedding, for the probe batch
    (the forward is stopped there: the backbone and neck run, nothing after)."""
    seen = []

    def stop(module, args):
        seen.append(args[0].clone())
        raise _Seen

    hook = model.position_embedding.register_forward_pre_hook(stop)
    try:
        with torch.no_grad():
            model([{"image": torch.zeros(3, h, w)} for h, w in PROBE_SIZES])
    except _Seen:
        pass
    finally:
        hook.remove()
    if not seen:
        raise ValueError(f"{type(model).__name__}'s forward never called its position_embedding")
    return seen[0]


def mask_rule(model: nn.Module):
    """Which of MASK_RULES the model's forward follows, by watching it (one rule where several fit the probe)."""
    seen = observed_mask(model)
    sizes = torch.tensor(PROBE_SIZES)
    padded = torch.zeros(len(PROBE_SIZES), 3, int(sizes[:, 0].max()), int(sizes[:, 1].max()))
    for rule in MASK_RULES:
        masks = padding_masks(padded, sizes, rule)
        if torch.equal(F.interpolate(masks[None], size=seen.shape[-2:]).to(torch.bool)[0], seen.bool()):
            return rule
    raise ValueError(f"{type(model).__name__} builds its padding masks by none of the known rules "
                     "(ones but each image, short of its size by 1 or 0 rows and columns; or no mask)")


def padding_masks(x: Tensor, image_sizes: Tensor, rule) -> Tensor:
    """[N, H, W] in x's dtype: 1 on padding (and, by `rule`, the last rows/columns of each image), 0 elsewhere."""
    if rule is None:
        return x.new_zeros(x.shape[0], x.shape[2], x.shape[3])
    valid = image_sizes.to(torch.long) - rule
    rows = torch.arange(x.shape[2], device=x.device)[None, :] < valid[:, 0, None]
    cols = torch.arange(x.shape[3], device=x.device)[None, :] < valid[:, 1, None]
    return (~(rows[:, :, None] & cols[:, None, :])).to(x.dtype)


def model_helper(model: nn.Module, name: str):
    """A function the model's own module uses (e.g. its `inverse_sigmoid`, whose eps differs between projects)."""
    return getattr(sys.modules.get(type(model).__module__), name, None)


class DetrexBody(nn.Module):
    """Padded batch + image sizes → {"pred_logits": [N, Q, C], "pred_boxes": [N, Q, 4] (cx, cy, w, h in 0..1)}."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.inverse_sigmoid = model_helper(model, "inverse_sigmoid")
        self.denoising = hasattr(model, "label_enc")  # DINO-style: (label, box) query pairs and attention masks
        self.mask_rule = mask_rule(model)

    def forward(self, images) -> dict[str, Tensor]:
        m = self.model
        x = images.tensor
        sizes = images.image_sizes
        sizes = sizes if isinstance(sizes, Tensor) else torch.tensor([list(s) for s in sizes])
        img_masks = padding_masks(x, sizes, self.mask_rule)
        feats = m.neck(m.backbone(x))
        masks = [F.interpolate(img_masks[None], size=f.shape[-2:]).to(torch.bool).squeeze(0) for f in feats]
        pos = [m.position_embedding(mask) for mask in masks]
        if self.denoising:  # no denoising queries at inference
            out = m.transformer(feats, masks, pos, (None, None), attn_masks=[None, None])
        else:
            out = m.transformer(feats, masks, pos, None if m.as_two_stage else m.query_embedding.weight)
        states, init_reference, inter_references = out[:3]
        last = static_size(states.shape[0]) - 1  # only the last decoder layer's predictions are inferred from
        reference = self.inverse_sigmoid(init_reference if last == 0 else inter_references[last - 1])
        delta = m.bbox_embed[last](states[last])
        if static_size(reference.shape[-1]) == 4:
            boxes = delta + reference
        else:
            boxes = torch.cat([delta[..., :2] + reference, delta[..., 2:]], -1)
        return {"pred_logits": m.class_embed[last](states[last]), "pred_boxes": boxes.sigmoid()}


def top_k(out: dict, image_sizes: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """detrex's `inference`: top-k of the sigmoid scores over queries × classes; boxes to xyxy in each image's own
    pixels. → (boxes [N, k, 4], scores [N, k], labels [N, k])."""
    logits, boxes = out["pred_logits"], out["pred_boxes"]
    classes = static_size(logits.shape[2])
    scores, index = logits.sigmoid().flatten(1).topk(k, dim=1)
    query = torch.div(index, classes, rounding_mode="floor")
    picked = boxes.gather(1, query[..., None].expand(-1, -1, 4))
    cx, cy, w, h = picked.unbind(-1)
    xyxy = torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], -1)
    scale = image_sizes.flip(-1).to(xyxy.dtype).repeat(1, 2)[:, None, :]
    return xyxy * scale, scores, index % classes


class DetrexAdapter(DetrAdapter):
    @torch.no_grad()
    def reference(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The model's own forward on list[dict]; its `inference` results (before detector_postprocess) stacked."""
        captured = []
        own = self.model.inference

        def spy(*args, **kwargs):  # copies: detector_postprocess then scales and clips the boxes in place
            results = own(*args, **kwargs)
            captured.extend((r.pred_boxes.tensor.clone(), r.scores.clone(), r.pred_classes.clone()) for r in results)
            return results

        self.model.inference = spy
        try:
            self.model([{"image": torch.from_numpy(np.ascontiguousarray(im)).float()} for im in images])
        finally:
            del self.model.inference
        return [torch.stack(field).cpu().numpy() for field in zip(*captured)]
