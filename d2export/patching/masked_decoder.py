"""Mask2Former's masked attention with its masks made once per query instead of once per head.

Upstream's decoder (Mask2Former's, OneFormer's) makes each layer's attention mask on the mask probabilities repeated
over the heads ([N * heads, Q, HW]): thresholded, rows that mask everything cleared (its forward loop), turned into
-inf / 0 and added to the logits (MultiheadAttention), every step on `heads` equal copies. In the export the decoder
makes the mask once per query and its cross-attention masks every head's logits from it: the same values, a
`heads`-th of the mask work (~12% of the R-50 graph's time on an AVX-512 CPU). The per-head tensor upstream's loop
still receives is left unused, and its work leaves the graph; verification's pinning matches the graph's threshold
made once per query to eager's made per head (d2export/verification/pinning.py)."""
from __future__ import annotations

import inspect
import math
import weakref

import torch
import torch.nn.functional as F

from d2export.patching.registry import module_where, register_patch

_HEADS_ARGS = ["output", "mask_features", "attn_mask_target_size"]

# The per-head masks handed to upstream's loop, by id while they live: (a weak reference to it, the per-query mask
# [N, Q, HW] it repeats, with the rows that mask everything already cleared).
_PER_QUERY: dict[int, tuple] = {}


def is_masked_decoder(module) -> bool:
    """Mask2Former's MultiScaleMaskedTransformerDecoder and its copies: per-head attention masks from
    `forward_prediction_heads(output, mask_features, attn_mask_target_size)`, MultiheadAttention cross-attention."""
    if not all(hasattr(module, a) for a in ("num_heads", "transformer_cross_attention_layers")):
        return False
    try:
        names = list(inspect.signature(type(module).forward_prediction_heads).parameters)[1:]
    except (AttributeError, TypeError, ValueError):
        return False
    return names == _HEADS_ARGS


@register_patch("masks-once-per-query", module=module_where(is_masked_decoder), method="forward_prediction_heads",
                why="the masked decoder makes, clears and converts each layer's attention mask on its probabilities "
                    "repeated per head ([N*8, Q, HW]: eight equal copies); made once per query, every head's "
                    "logits masked from it")
def forward_prediction_heads(self, output, mask_features, attn_mask_target_size):
    outputs_class, outputs_mask, attn_mask = type(self).forward_prediction_heads(
        self, output, mask_features, attn_mask_target_size)
    n, heads = outputs_mask.shape[0], self.num_heads
    if not (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool and attn_mask.dim() == 3):
        return outputs_class, outputs_mask, attn_mask
    masked = per_query_masks(outputs_mask, attn_mask_target_size)
    per_head = masked[:, None].expand(n, heads, *masked.shape[1:]).flatten(0, 1)  # what upstream's loop expects
    if _differs(per_head, attn_mask):
        return outputs_class, outputs_mask, attn_mask  # another decoder's masks: its own, per head
    key = id(per_head)
    _PER_QUERY[key] = (weakref.ref(per_head, lambda _: _PER_QUERY.pop(key, None)), masked)
    return outputs_class, outputs_mask, per_head


def per_query_masks(outputs_mask, size):
    """[N, Q, h*w] True where the query does not attend: upstream's threshold on one copy of the probabilities, and
    its loop's clearing of rows that mask everything (such a query attends everywhere)."""
    probs = F.interpolate(outputs_mask, size=size, mode="bilinear", align_corners=False)
    masked = probs.sigmoid().flatten(2) < 0.5
    return masked & ~masked.all(-1, keepdim=True)


def _differs(ours, theirs) -> bool:
    """Whether the per-head masks we would hand on differ from the decoder's own (after the loop's clearing, which
    leaves no row masking everything): checked on the values where there are any (TorchScript's trace, eager calls);
    torch.export's fake tensors hold none, and verification compares the graph with the model's own forward."""
    if ours.shape != theirs.shape:
        return True
    if torch.compiler.is_exporting():
        return False
    cleared = theirs & ~theirs.all(-1, keepdim=True)
    return not torch.equal(ours, cleared)


@register_patch("masked-attention-per-query", module=torch.nn.MultiheadAttention,
                why="MultiheadAttention turns a per-head bool mask into -inf/0 ([N*heads, Q, HW]) and adds it to "
                    "the logits; given the masked decoder's per-query mask (masks-once-per-query), the bias is "
                    "made once per query and added to every head's logits by broadcasting")
def masked_attention(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                     average_attn_weights=True, is_causal=False):
    entry = _PER_QUERY.get(id(attn_mask)) if attn_mask is not None else None
    if entry is None or entry[0]() is not attn_mask or query.dim() != 3 or self.batch_first \
            or not self._qkv_same_embed_dim or self.bias_k is not None or self.add_zero_attn \
            or (self.training and self.dropout > 0) or key_padding_mask is not None or is_causal:
        return NotImplemented
    masked = entry[1]  # [N, L, S]
    length, n, embed = query.shape
    heads = self.num_heads
    head = embed // heads
    q, k, v = F._in_projection_packed(query, key, value, self.in_proj_weight, self.in_proj_bias)

    def split(x):  # [T, N, E] -> [N*heads, T, head], as F.multi_head_attention_forward lays the heads out
        return x.reshape(x.shape[0], n * heads, head).transpose(0, 1)

    q, k, v = split(q), split(k), split(v)
    logits = torch.bmm(q * math.sqrt(1.0 / float(head)), k.transpose(-2, -1))
    bias = torch.zeros(masked.shape, dtype=logits.dtype, device=logits.device).masked_fill(masked, float("-inf"))
    logits = logits.view(n, heads, length, -1) + bias[:, None]  # upstream's sum; the bias made once per query
    weights = F.softmax(logits, dim=-1)
    out = torch.bmm(weights.flatten(0, 1), v).transpose(0, 1).reshape(length * n, embed)
    out = F.linear(out, self.out_proj.weight, self.out_proj.bias).view(length, n, embed)
    if not need_weights:
        return out, None
    return out, weights.mean(dim=1) if average_attn_weights else weights
