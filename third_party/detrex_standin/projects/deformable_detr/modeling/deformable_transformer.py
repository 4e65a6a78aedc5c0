import math

import torch
import torch.nn as nn

from detrex.layers import (FFN, BaseTransformerLayer, MultiheadAttention, MultiScaleDeformableAttention,
                           TransformerLayerSequence)
from detrex.utils import inverse_sigmoid


class DeformableDetrTransformerEncoder(TransformerLayerSequence):
    def __init__(self, embed_dim=256, num_heads=8, feedforward_dim=1024, attn_dropout=0.1, ffn_dropout=0.1,
                 num_layers=6, post_norm=False, num_feature_levels=4):
        super().__init__(
            transformer_layers=BaseTransformerLayer(
                attn=MultiScaleDeformableAttention(embed_dim=embed_dim, num_heads=num_heads, dropout=attn_dropout,
                                                   batch_first=True, num_levels=num_feature_levels),
                ffn=FFN(embed_dim=embed_dim, feedforward_dim=feedforward_dim, output_dim=embed_dim, num_fcs=2,
                        ffn_drop=ffn_dropout),
                norm=nn.LayerNorm(embed_dim),
                operation_order=("self_attn", "norm", "ffn", "norm"),
            ),
            num_layers=num_layers,
        )
        self.embed_dim = self.layers[0].embed_dim
        self.pre_norm = self.layers[0].pre_norm
        self.post_norm_layer = nn.LayerNorm(self.embed_dim) if post_norm else None

    def forward(self, query, key, value, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, **kwargs):
        for layer in self.layers:
            query = layer(query, key, value, query_pos=query_pos, attn_masks=attn_masks,
                          query_key_padding_mask=query_key_padding_mask, key_padding_mask=key_padding_mask, **kwargs)
        return query if self.post_norm_layer is None else self.post_norm_layer(query)


class DeformableDetrTransformerDecoder(TransformerLayerSequence):
    def __init__(self, embed_dim=256, num_heads=8, feedforward_dim=1024, attn_dropout=0.1, ffn_dropout=0.1,
                 num_layers=6, return_intermediate=True, num_feature_levels=4):
        super().__init__(
            transformer_layers=BaseTransformerLayer(
                attn=[MultiheadAttention(embed_dim=embed_dim, num_heads=num_heads, attn_drop=attn_dropout,
                                         batch_first=True),
                      MultiScaleDeformableAttention(embed_dim=embed_dim, num_heads=num_heads, dropout=attn_dropout,
                                                    batch_first=True, num_levels=num_feature_levels)],
                ffn=FFN(embed_dim=embed_dim, feedforward_dim=feedforward_dim, output_dim=embed_dim,
                        ffn_drop=ffn_dropout),
                norm=nn.LayerNorm(embed_dim),
                operation_order=("self_attn", "norm", "cross_attn", "norm", "ffn", "norm"),
            ),
            num_layers=num_layers,
        )
        self.return_intermediate = return_intermediate
        self.bbox_embed = None  # set by the detector: iterative box refinement
        self.class_embed = None  # set by the detector: two-stage proposals

    def forward(self, query, key, value, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, reference_points=None, valid_ratios=None,
                **kwargs):
        output = query
        intermediate, intermediate_reference_points = [], []
        for layer_idx, layer in enumerate(self.layers):
            if reference_points.shape[-1] == 4:
                reference_points_input = reference_points[:, :, None] * torch.cat([valid_ratios, valid_ratios],
                                                                                  -1)[:, None]
            else:
                reference_points_input = reference_points[:, :, None] * valid_ratios[:, None]
            output = layer(output, key, value, query_pos=query_pos, key_pos=key_pos, attn_masks=attn_masks,
                           query_key_padding_mask=query_key_padding_mask, key_padding_mask=key_padding_mask,
                           reference_points=reference_points_input, **kwargs)
            if self.bbox_embed is not None:
                tmp = self.bbox_embed[layer_idx](output)
                if reference_points.shape[-1] == 4:
                    new_reference_points = (tmp + inverse_sigmoid(reference_points)).sigmoid()
                else:
                    new_reference_points = tmp
                    new_reference_points[..., :2] = tmp[..., :2] + inverse_sigmoid(reference_points)
                    new_reference_points = new_reference_points.sigmoid()
                reference_points = new_reference_points.detach()
            if self.return_intermediate:
                intermediate.append(output)
                intermediate_reference_points.append(reference_points)
        if self.return_intermediate:
            return torch.stack(intermediate), torch.stack(intermediate_reference_points)
        return output, reference_points


class DeformableDetrTransformer(nn.Module):
    def __init__(self, encoder=None, decoder=None, as_two_stage=False, num_feature_levels=4,
                 two_stage_num_proposals=300):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.as_two_stage = as_two_stage
        self.num_feature_levels = num_feature_levels
        self.two_stage_num_proposals = two_stage_num_proposals
        self.embed_dim = self.encoder.embed_dim
        self.level_embeds = nn.Parameter(torch.Tensor(self.num_feature_levels, self.embed_dim))
        if self.as_two_stage:
            self.enc_output = nn.Linear(self.embed_dim, self.embed_dim)
            self.enc_output_norm = nn.LayerNorm(self.embed_dim)
            self.pos_trans = nn.Linear(self.embed_dim * 2, self.embed_dim * 2)
            self.pos_trans_norm = nn.LayerNorm(self.embed_dim * 2)
        else:
            self.reference_points = nn.Linear(self.embed_dim, 2)
        self.init_weights()

    def init_weights(self):
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for m in self.modules():
            if isinstance(m, MultiScaleDeformableAttention):
                m.init_weights()
        if not self.as_two_stage:
            nn.init.xavier_normal_(self.reference_points.weight.data, gain=1.0)
            nn.init.constant_(self.reference_points.bias.data, 0.0)
        nn.init.normal_(self.level_embeds)

    def gen_encoder_output_proposals(self, memory, memory_padding_mask, spatial_shapes):
        n = memory.shape[0]
        proposals, cur = [], 0
        for lvl, (H, W) in enumerate(spatial_shapes):
            mask = memory_padding_mask[:, cur:cur + H * W].view(n, H, W, 1)
            valid_h = torch.sum(~mask[:, :, 0, 0], 1)
            valid_w = torch.sum(~mask[:, 0, :, 0], 1)
            grid_y, grid_x = torch.meshgrid(torch.linspace(0, H - 1, H, dtype=torch.float32, device=memory.device),
                                            torch.linspace(0, W - 1, W, dtype=torch.float32, device=memory.device),
                                            indexing="ij")
            grid = torch.cat([grid_x.unsqueeze(-1), grid_y.unsqueeze(-1)], -1)
            scale = torch.cat([valid_w.unsqueeze(-1), valid_h.unsqueeze(-1)], 1).view(n, 1, 1, 2)
            grid = (grid.unsqueeze(0).expand(n, -1, -1, -1) + 0.5) / scale
            wh = torch.ones_like(grid) * 0.05 * (2.0 ** lvl)
            proposals.append(torch.cat((grid, wh), -1).view(n, -1, 4))
            cur += H * W
        output_proposals = torch.cat(proposals, 1)
        valid = ((output_proposals > 0.01) & (output_proposals < 0.99)).all(-1, keepdim=True)
        output_proposals = torch.log(output_proposals / (1 - output_proposals))
        output_proposals = output_proposals.masked_fill(memory_padding_mask.unsqueeze(-1), float("inf"))
        output_proposals = output_proposals.masked_fill(~valid, float("inf"))
        output_memory = memory.masked_fill(memory_padding_mask.unsqueeze(-1), 0.0).masked_fill(~valid, 0.0)
        return self.enc_output_norm(self.enc_output(output_memory)), output_proposals

    @staticmethod
    def get_reference_points(spatial_shapes, valid_ratios, device):
        reference_points_list = []
        for lvl, (H, W) in enumerate(spatial_shapes):
            ref_y, ref_x = torch.meshgrid(torch.linspace(0.5, H - 0.5, H, dtype=torch.float32, device=device),
                                          torch.linspace(0.5, W - 0.5, W, dtype=torch.float32, device=device),
                                          indexing="ij")
            ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, lvl, 1] * H)
            ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, lvl, 0] * W)
            reference_points_list.append(torch.stack((ref_x, ref_y), -1))
        reference_points = torch.cat(reference_points_list, 1)
        return reference_points[:, :, None] * valid_ratios[:, None]

    def get_valid_ratio(self, mask):
        _, H, W = mask.shape
        valid_h = torch.sum(~mask[:, :, 0], 1)
        valid_w = torch.sum(~mask[:, 0, :], 1)
        return torch.stack([valid_w.float() / W, valid_h.float() / H], -1)

    def get_proposal_pos_embed(self, proposals, num_pos_feats=128, temperature=10000):
        dim_t = torch.arange(num_pos_feats, dtype=torch.float32, device=proposals.device)
        dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / num_pos_feats)
        pos = proposals.sigmoid() * (2 * math.pi)
        pos = pos[:, :, :, None] / dim_t
        return torch.stack((pos[:, :, :, 0::2].sin(), pos[:, :, :, 1::2].cos()), dim=4).flatten(2)

    def flatten_levels(self, multi_level_feats, multi_level_masks, multi_level_pos_embeds):
        feat_flatten, mask_flatten, lvl_pos_embed_flatten, spatial_shapes = [], [], [], []
        for lvl, (feat, mask, pos_embed) in enumerate(zip(multi_level_feats, multi_level_masks,
                                                          multi_level_pos_embeds)):
            bs, c, h, w = feat.shape
            spatial_shapes.append((h, w))
            feat_flatten.append(feat.flatten(2).transpose(1, 2))
            mask_flatten.append(mask.flatten(1))
            lvl_pos_embed_flatten.append(pos_embed.flatten(2).transpose(1, 2) + self.level_embeds[lvl].view(1, 1, -1))
        feat_flatten = torch.cat(feat_flatten, 1)
        spatial_shapes = torch.as_tensor(spatial_shapes, dtype=torch.long, device=feat_flatten.device)
        level_start_index = torch.cat((spatial_shapes.new_zeros((1,)), spatial_shapes.prod(1).cumsum(0)[:-1]))
        valid_ratios = torch.stack([self.get_valid_ratio(m) for m in multi_level_masks], 1)
        return (feat_flatten, torch.cat(mask_flatten, 1), torch.cat(lvl_pos_embed_flatten, 1), spatial_shapes,
                level_start_index, valid_ratios)

    def forward(self, multi_level_feats, multi_level_masks, multi_level_pos_embeds, query_embed, **kwargs):
        assert self.as_two_stage or query_embed is not None
        (feat_flatten, mask_flatten, lvl_pos_embed_flatten, spatial_shapes, level_start_index,
         valid_ratios) = self.flatten_levels(multi_level_feats, multi_level_masks, multi_level_pos_embeds)
        reference_points = self.get_reference_points(spatial_shapes, valid_ratios, device=feat_flatten.device)
        memory = self.encoder(query=feat_flatten, key=None, value=None, query_pos=lvl_pos_embed_flatten,
                              query_key_padding_mask=mask_flatten, spatial_shapes=spatial_shapes,
                              reference_points=reference_points, level_start_index=level_start_index,
                              valid_ratios=valid_ratios, **kwargs)
        bs, _, c = memory.shape
        if self.as_two_stage:
            output_memory, output_proposals = self.gen_encoder_output_proposals(memory, mask_flatten, spatial_shapes)
            enc_outputs_class = self.decoder.class_embed[self.decoder.num_layers](output_memory)
            enc_outputs_coord_unact = self.decoder.bbox_embed[self.decoder.num_layers](output_memory) + output_proposals
            topk_proposals = torch.topk(enc_outputs_class[..., 0], self.two_stage_num_proposals, dim=1)[1]
            topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1,
                                             topk_proposals.unsqueeze(-1).repeat(1, 1, 4)).detach()
            reference_points = topk_coords_unact.sigmoid()
            init_reference_out = reference_points
            pos_trans_out = self.pos_trans_norm(self.pos_trans(self.get_proposal_pos_embed(topk_coords_unact)))
            query_pos, query = torch.split(pos_trans_out, c, dim=2)
        else:
            query_pos, query = torch.split(query_embed, c, dim=1)
            query_pos = query_pos.unsqueeze(0).expand(bs, -1, -1)
            query = query.unsqueeze(0).expand(bs, -1, -1)
            reference_points = self.reference_points(query_pos).sigmoid()
            init_reference_out = reference_points
        inter_states, inter_references = self.decoder(query=query, key=None, value=memory, query_pos=query_pos,
                                                      key_padding_mask=mask_flatten,
                                                      reference_points=reference_points,
                                                      spatial_shapes=spatial_shapes,
                                                      level_start_index=level_start_index,
                                                      valid_ratios=valid_ratios, **kwargs)
        if self.as_two_stage:
            return inter_states, init_reference_out, inter_references, enc_outputs_class, enc_outputs_coord_unact
        return inter_states, init_reference_out, inter_references, None, None
