"""Mask2Former's masked-attention transformer decoder (`MultiScaleMaskedTransformerDecoder`), inference path.

Each layer: cross-attention of the queries to one pixel-decoder level (round robin over 3 levels), restricted by
the previous layer's mask prediction (the "masked attention"), then self-attention, then an FFN. Layer modules use
`nn.MultiheadAttention` with sequence-first tensors, as upstream.
"""
import logging
from typing import Optional

import fvcore.nn.weight_init as weight_init
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from detectron2.config import configurable
from detectron2.layers import Conv2d

from .maskformer_transformer_decoder import TRANSFORMER_DECODER_REGISTRY
from .position_encoding import PositionEmbeddingSine


def _get_activation_fn(activation):
    table = {"relu": F.relu, "gelu": F.gelu, "glu": F.glu}
    if activation not in table:
        raise RuntimeError(f"activation should be relu/gelu, not {activation}.")
    return table[activation]


def _xavier_matrices(module):
    for p in module.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)


def _add_pos(tensor, pos: Optional[Tensor]):
    return tensor if pos is None else tensor + pos


class SelfAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0, activation="relu", normalize_before=False):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = _get_activation_fn(activation)
        self.normalize_before = normalize_before
        _xavier_matrices(self)

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return _add_pos(tensor, pos)

    def forward_post(self, tgt, tgt_mask=None, tgt_key_padding_mask=None, query_pos=None):
        q = k = self.with_pos_embed(tgt, query_pos)
        attended = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        return self.norm(tgt + self.dropout(attended))

    def forward_pre(self, tgt, tgt_mask=None, tgt_key_padding_mask=None, query_pos=None):
        normed = self.norm(tgt)
        q = k = self.with_pos_embed(normed, query_pos)
        attended = self.self_attn(q, k, value=normed, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        return tgt + self.dropout(attended)

    def forward(self, tgt, tgt_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                query_pos: Optional[Tensor] = None):
        run = self.forward_pre if self.normalize_before else self.forward_post
        return run(tgt, tgt_mask, tgt_key_padding_mask, query_pos)


class CrossAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0, activation="relu", normalize_before=False):
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = _get_activation_fn(activation)
        self.normalize_before = normalize_before
        _xavier_matrices(self)

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return _add_pos(tensor, pos)

    def forward_post(self, tgt, memory, memory_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        attended = self.multihead_attn(query=self.with_pos_embed(tgt, query_pos), key=self.with_pos_embed(memory, pos),
                                       value=memory, attn_mask=memory_mask,
                                       key_padding_mask=memory_key_padding_mask)[0]
        return self.norm(tgt + self.dropout(attended))

    def forward_pre(self, tgt, memory, memory_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        normed = self.norm(tgt)
        attended = self.multihead_attn(query=self.with_pos_embed(normed, query_pos),
                                       key=self.with_pos_embed(memory, pos), value=memory, attn_mask=memory_mask,
                                       key_padding_mask=memory_key_padding_mask)[0]
        return tgt + self.dropout(attended)

    def forward(self, tgt, memory, memory_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, pos: Optional[Tensor] = None,
                query_pos: Optional[Tensor] = None):
        run = self.forward_pre if self.normalize_before else self.forward_post
        return run(tgt, memory, memory_mask, memory_key_padding_mask, pos, query_pos)


class FFNLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward=2048, dropout=0.0, activation="relu", normalize_before=False):
        super().__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.activation = _get_activation_fn(activation)
        self.normalize_before = normalize_before
        _xavier_matrices(self)

    def _ffn(self, x):
        return self.linear2(self.dropout(self.activation(self.linear1(x))))

    def forward_post(self, tgt):
        return self.norm(tgt + self.dropout(self._ffn(tgt)))

    def forward_pre(self, tgt):
        return tgt + self.dropout(self._ffn(self.norm(tgt)))

    def forward(self, tgt):
        return self.forward_pre(tgt) if self.normalize_before else self.forward_post(tgt)


class MLP(nn.Module):
    """`num_layers` linear layers with ReLU between them."""

    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        dims_in = [input_dim] + [hidden_dim] * (num_layers - 1)
        dims_out = [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims_in, dims_out))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < self.num_layers - 1:
                x = F.relu(x)
        return x


@TRANSFORMER_DECODER_REGISTRY.register()
class MultiScaleMaskedTransformerDecoder(nn.Module):
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # checkpoints before version 2 called the query features "static_query"
        if (local_metadata.get("version", None) or 0) < 2:
            renamed = [k for k in state_dict if "static_query" in k]
            for k in renamed:
                state_dict[k.replace("static_query", "query_feat")] = state_dict.pop(k)
            if renamed:
                logging.getLogger(__name__).warning(
                    f"Weight format of {type(self).__name__} have changed! Applying automatic conversion now ...")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @configurable
    def __init__(
        self,
        in_channels,
        mask_classification=True,
        *,
        num_classes: int,
        hidden_dim: int,
        num_queries: int,
        nheads: int,
        dim_feedforward: int,
        dec_layers: int,
        pre_norm: bool,
        mask_dim: int,
        enforce_input_project: bool,
    ):
        super().__init__()
        assert mask_classification, "Only support mask classification model"
        self.mask_classification = mask_classification

        self.pe_layer = PositionEmbeddingSine(hidden_dim // 2, normalize=True)

        self.num_heads = nheads
        self.num_layers = dec_layers
        self.transformer_self_attention_layers = nn.ModuleList()
        self.transformer_cross_attention_layers = nn.ModuleList()
        self.transformer_ffn_layers = nn.ModuleList()
        for _ in range(self.num_layers):
            self.transformer_self_attention_layers.append(
                SelfAttentionLayer(d_model=hidden_dim, nhead=nheads, dropout=0.0, normalize_before=pre_norm))
            self.transformer_cross_attention_layers.append(
                CrossAttentionLayer(d_model=hidden_dim, nhead=nheads, dropout=0.0, normalize_before=pre_norm))
            self.transformer_ffn_layers.append(
                FFNLayer(d_model=hidden_dim, dim_feedforward=dim_feedforward, dropout=0.0,
                         normalize_before=pre_norm))
        self.decoder_norm = nn.LayerNorm(hidden_dim)

        self.num_queries = num_queries
        self.query_feat = nn.Embedding(num_queries, hidden_dim)   # learned query content
        self.query_embed = nn.Embedding(num_queries, hidden_dim)  # learned query position

        # three pixel-decoder scales, always
        self.num_feature_levels = 3
        self.level_embed = nn.Embedding(self.num_feature_levels, hidden_dim)
        self.input_proj = nn.ModuleList()
        for _ in range(self.num_feature_levels):
            if in_channels != hidden_dim or enforce_input_project:
                proj = Conv2d(in_channels, hidden_dim, kernel_size=1)
                weight_init.c2_xavier_fill(proj)
                self.input_proj.append(proj)
            else:
                self.input_proj.append(nn.Sequential())

        if self.mask_classification:
            self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.mask_embed = MLP(hidden_dim, hidden_dim, mask_dim, 3)

    @classmethod
    def from_config(cls, cfg, in_channels, mask_classification):
        mf = cfg.MODEL.MASK_FORMER
        # DEC_LAYERS counts the prediction on the learned queries before any layer, as upstream's losses do
        assert mf.DEC_LAYERS >= 1
        return {
            "in_channels": in_channels,
            "mask_classification": mask_classification,
            "num_classes": cfg.MODEL.SEM_SEG_HEAD.NUM_CLASSES,
            "hidden_dim": mf.HIDDEN_DIM,
            "num_queries": mf.NUM_OBJECT_QUERIES,
            "nheads": mf.NHEADS,
            "dim_feedforward": mf.DIM_FEEDFORWARD,
            "dec_layers": mf.DEC_LAYERS - 1,
            "pre_norm": mf.PRE_NORM,
            "enforce_input_project": mf.ENFORCE_INPUT_PROJ,
            "mask_dim": cfg.MODEL.SEM_SEG_HEAD.MASK_DIM,
        }

    def forward(self, x, mask_features, mask=None):
        """x: 3 feature maps (N, C, H_l, W_l), coarsest first; mask_features (N, mask_dim, H, W)."""
        assert len(x) == self.num_feature_levels
        del mask  # the padding mask is not used

        src, pos, size_list = [], [], []
        for i in range(self.num_feature_levels):
            size_list.append(x[i].shape[-2:])
            # (N, C, H, W) -> (HW, N, C)
            pos.append(self.pe_layer(x[i], None).flatten(2).permute(2, 0, 1))
            level = self.input_proj[i](x[i]).flatten(2) + self.level_embed.weight[i][None, :, None]
            src.append(level.permute(2, 0, 1))

        bs = src[0].shape[1]
        query_embed = self.query_embed.weight.unsqueeze(1).repeat(1, bs, 1)  # (Q, N, C)
        output = self.query_feat.weight.unsqueeze(1).repeat(1, bs, 1)

        predictions_class, predictions_mask = [], []
        outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(
            output, mask_features, attn_mask_target_size=size_list[0])
        predictions_class.append(outputs_class)
        predictions_mask.append(outputs_mask)

        for i in range(self.num_layers):
            level_index = i % self.num_feature_levels
            # a query whose mask covers nothing at this level would attend to nothing (NaN): let it see everything
            attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
            output = self.transformer_cross_attention_layers[i](
                output, src[level_index], memory_mask=attn_mask, memory_key_padding_mask=None,
                pos=pos[level_index], query_pos=query_embed)
            output = self.transformer_self_attention_layers[i](
                output, tgt_mask=None, tgt_key_padding_mask=None, query_pos=query_embed)
            output = self.transformer_ffn_layers[i](output)

            outputs_class, outputs_mask, attn_mask = self.forward_prediction_heads(
                output, mask_features, attn_mask_target_size=size_list[(i + 1) % self.num_feature_levels])
            predictions_class.append(outputs_class)
            predictions_mask.append(outputs_mask)

        assert len(predictions_class) == self.num_layers + 1
        return {
            "pred_logits": predictions_class[-1],
            "pred_masks": predictions_mask[-1],
            "aux_outputs": self._set_aux_loss(
                predictions_class if self.mask_classification else None, predictions_mask),
        }

    def forward_prediction_heads(self, output, mask_features, attn_mask_target_size):
        """(Q, N, C) queries -> class logits (N, Q, K+1), mask logits (N, Q, H, W) at the mask-feature size, and the
        next layer's attention mask (N * heads, Q, h*w) at `attn_mask_target_size`: True where the query's mask
        probability there is below 0.5 (not attended)."""
        decoded = self.decoder_norm(output).transpose(0, 1)
        outputs_class = self.class_embed(decoded)
        outputs_mask = torch.einsum("bqc,bchw->bqhw", self.mask_embed(decoded), mask_features)

        attn_mask = F.interpolate(outputs_mask, size=attn_mask_target_size, mode="bilinear", align_corners=False)
        attn_mask = attn_mask.sigmoid().flatten(2).unsqueeze(1).repeat(1, self.num_heads, 1, 1).flatten(0, 1)
        attn_mask = (attn_mask < 0.5).bool().detach()
        return outputs_class, outputs_mask, attn_mask

    @torch.jit.unused
    def _set_aux_loss(self, outputs_class, outputs_seg_masks):
        if self.mask_classification:
            return [{"pred_logits": a, "pred_masks": b} for a, b in zip(outputs_class[:-1], outputs_seg_masks[:-1])]
        return [{"pred_masks": b} for b in outputs_seg_masks[:-1]]
