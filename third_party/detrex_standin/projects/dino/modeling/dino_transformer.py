import torch
import torch.nn as nn

from detrex.layers import (FFN, MLP, BaseTransformerLayer, MultiheadAttention, MultiScaleDeformableAttention,
                           TransformerLayerSequence, get_sine_pos_embed)
from detrex.utils import inverse_sigmoid
from projects.deformable_detr.modeling import DeformableDetrTransformer, DeformableDetrTransformerEncoder


class DINOTransformerEncoder(DeformableDetrTransformerEncoder):
    pass


class DINOTransformerDecoder(TransformerLayerSequence):
    """Deformable decoder whose query positions come from the sine code of the current reference boxes, with
    "look forward twice" (the intermediate references keep their gradient path to the previous layer)."""

    def __init__(self, embed_dim=256, num_heads=8, feedforward_dim=1024, attn_dropout=0.1, ffn_dropout=0.1,
                 num_layers=6, return_intermediate=True, num_feature_levels=4, look_forward_twice=True):
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
        self.ref_point_head = MLP(2 * embed_dim, embed_dim, embed_dim, 2)
        self.bbox_embed = None
        self.class_embed = None
        self.look_forward_twice = look_forward_twice
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, query, key, value, query_pos=None, key_pos=None, attn_masks=None,
                query_key_padding_mask=None, key_padding_mask=None, reference_points=None, valid_ratios=None,
                **kwargs):
        output = query
        bs = output.shape[0]
        if reference_points.dim() == 2:
            reference_points = reference_points.unsqueeze(0).repeat(bs, 1, 1)
        intermediate, intermediate_reference_points = [], []
        for layer_idx, layer in enumerate(self.layers):
            reference_points_input = reference_points[:, :, None] * torch.cat([valid_ratios, valid_ratios],
                                                                              -1)[:, None]
            query_sine_embed = get_sine_pos_embed(reference_points_input[:, :, 0, :])
            query_pos = self.ref_point_head(query_sine_embed)
            output = layer(output, key, value, query_pos=query_pos, key_pos=key_pos,
                           query_sine_embed=query_sine_embed, attn_masks=attn_masks,
                           query_key_padding_mask=query_key_padding_mask, key_padding_mask=key_padding_mask,
                           reference_points=reference_points_input, **kwargs)
            tmp = self.bbox_embed[layer_idx](output)
            new_reference_points = (tmp + inverse_sigmoid(reference_points)).sigmoid()
            reference_points = new_reference_points.detach()
            if self.return_intermediate:
                intermediate.append(self.norm(output))
                intermediate_reference_points.append(new_reference_points if self.look_forward_twice
                                                     else reference_points)
        if self.return_intermediate:
            return torch.stack(intermediate), torch.stack(intermediate_reference_points)
        return output, reference_points


class DINOTransformer(DeformableDetrTransformer):
    """Two-stage by construction: the top-scoring encoder proposals (max over classes) become the decoder's
    reference boxes, the content queries are learnt (`tgt_embed`)."""

    def __init__(self, encoder=None, decoder=None, num_feature_levels=4, two_stage_num_proposals=900,
                 learnt_init_query=True):
        nn.Module.__init__(self)
        self.encoder = encoder
        self.decoder = decoder
        self.as_two_stage = True
        self.num_feature_levels = num_feature_levels
        self.two_stage_num_proposals = two_stage_num_proposals
        self.embed_dim = self.encoder.embed_dim
        self.level_embeds = nn.Parameter(torch.Tensor(self.num_feature_levels, self.embed_dim))
        self.learnt_init_query = learnt_init_query
        if learnt_init_query:
            self.tgt_embed = nn.Embedding(two_stage_num_proposals, self.embed_dim)
        self.enc_output = nn.Linear(self.embed_dim, self.embed_dim)
        self.enc_output_norm = nn.LayerNorm(self.embed_dim)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for m in self.modules():
            if isinstance(m, MultiScaleDeformableAttention):
                m.init_weights()
        nn.init.normal_(self.level_embeds)

    def forward(self, multi_level_feats, multi_level_masks, multi_level_pos_embeds, query_embed, attn_masks,
                **kwargs):
        (feat_flatten, mask_flatten, lvl_pos_embed_flatten, spatial_shapes, level_start_index,
         valid_ratios) = self.flatten_levels(multi_level_feats, multi_level_masks, multi_level_pos_embeds)
        reference_points = self.get_reference_points(spatial_shapes, valid_ratios, device=feat_flatten.device)
        memory = self.encoder(query=feat_flatten, key=None, value=None, query_pos=lvl_pos_embed_flatten,
                              query_key_padding_mask=mask_flatten, spatial_shapes=spatial_shapes,
                              reference_points=reference_points, level_start_index=level_start_index,
                              valid_ratios=valid_ratios, **kwargs)
        bs = memory.shape[0]
        output_memory, output_proposals = self.gen_encoder_output_proposals(memory, mask_flatten, spatial_shapes)
        enc_outputs_class = self.decoder.class_embed[self.decoder.num_layers](output_memory)
        enc_outputs_coord_unact = self.decoder.bbox_embed[self.decoder.num_layers](output_memory) + output_proposals
        topk_proposals = torch.topk(enc_outputs_class.max(-1)[0], self.two_stage_num_proposals, dim=1)[1]
        topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1, topk_proposals.unsqueeze(-1).repeat(1, 1, 4))
        reference_points = topk_coords_unact.detach().sigmoid()
        if query_embed[1] is not None:  # denoising queries (training)
            reference_points = torch.cat([query_embed[1].sigmoid(), reference_points], 1)
        init_reference_out = reference_points
        target_unact = torch.gather(output_memory, 1,
                                    topk_proposals.unsqueeze(-1).repeat(1, 1, output_memory.shape[-1]))
        target = self.tgt_embed.weight[None].repeat(bs, 1, 1) if self.learnt_init_query else target_unact.detach()
        if query_embed[0] is not None:
            target = torch.cat([query_embed[0], target], 1)
        inter_states, inter_references = self.decoder(query=target, key=memory, value=memory, query_pos=None,
                                                      key_padding_mask=mask_flatten,
                                                      reference_points=reference_points,
                                                      spatial_shapes=spatial_shapes,
                                                      level_start_index=level_start_index,
                                                      valid_ratios=valid_ratios, attn_masks=attn_masks, **kwargs)
        return inter_states, init_reference_out, inter_references, target_unact, topk_coords_unact.sigmoid()
