import copy

import torch.nn as nn


class BaseTransformerLayer(nn.Module):
    """A layer described by its `operation_order` (self_attn, cross_attn, norm, ffn), mmcv's way."""

    def __init__(self, attn, ffn, norm, operation_order=None):
        super().__init__()
        self.operation_order = operation_order
        self.pre_norm = operation_order[0] == "norm"
        num_attn = operation_order.count("self_attn") + operation_order.count("cross_attn")
        attn = attn if isinstance(attn, list) else [copy.deepcopy(attn) for _ in range(num_attn)]
        self.attentions = nn.ModuleList(attn)
        self.num_attn = num_attn
        self.embed_dim = self.attentions[0].embed_dim
        self.ffns = nn.ModuleList(copy.deepcopy(ffn) for _ in range(operation_order.count("ffn")))
        self.norms = nn.ModuleList(copy.deepcopy(norm) for _ in range(operation_order.count("norm")))

    def forward(self, query, key=None, value=None, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, **kwargs):
        norm_i = attn_i = ffn_i = 0
        identity = query
        attn_masks = [None] * self.num_attn if attn_masks is None else attn_masks
        for op in self.operation_order:
            if op == "self_attn":
                query = self.attentions[attn_i](query, query, query, identity if self.pre_norm else None,
                                                query_pos=query_pos, key_pos=query_pos, attn_mask=attn_masks[attn_i],
                                                key_padding_mask=query_key_padding_mask, **kwargs)
                attn_i += 1
                identity = query
            elif op == "norm":
                query = self.norms[norm_i](query)
                norm_i += 1
            elif op == "cross_attn":
                query = self.attentions[attn_i](query, key, value, identity if self.pre_norm else None,
                                                query_pos=query_pos, key_pos=key_pos, attn_mask=attn_masks[attn_i],
                                                key_padding_mask=key_padding_mask, **kwargs)
                attn_i += 1
                identity = query
            elif op == "ffn":
                query = self.ffns[ffn_i](query, identity if self.pre_norm else None)
                ffn_i += 1
        return query


class TransformerLayerSequence(nn.Module):
    def __init__(self, transformer_layers=None, num_layers=None):
        super().__init__()
        self.num_layers = num_layers
        self.layers = nn.ModuleList(copy.deepcopy(transformer_layers) for _ in range(num_layers))

    def forward(self, *args, **kwargs):
        raise NotImplementedError
