"""DeepSolo's deformable transformer: the encoder proposes one cubic Bezier centre line per memory cell, the top-K
are sampled into point queries, and a decoder refines the points (intra-query attention over each line's points,
attention across queries, deformable cross-attention at the points)."""
from math import comb as n_over_k  # upstream: scipy.special.comb

import torch
from torch import nn
from torch.nn.init import normal_

from deepsolo.modeling.model.utils import MLP, gen_point_pos_embed
from deepsolo.utils.curve_utils import upcast
from deepsolo.utils.misc import inverse_sigmoid
from testr.layers.deformable_transformer import (DeformableTransformerEncoder, DeformableTransformerEncoderLayer,
                                                 _get_activation_fn, _get_clones)

from .ms_deform_attn import MSDeformAttn


class DeformableTransformer(nn.Module):
    def __init__(self, temp=10000, d_model=256, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                 dim_feedforward=1024, dropout=0.1, activation="relu", return_intermediate_dec=False,
                 num_feature_levels=4, dec_n_points=4, enc_n_points=4, num_proposals=300, num_points=25):
        super().__init__()
        self.d_model = d_model
        self.nhead = nhead
        self.num_proposals = num_proposals

        encoder_layer = DeformableTransformerEncoderLayer(d_model, dim_feedforward, dropout, activation,
                                                          num_feature_levels, nhead, enc_n_points)
        self.encoder = DeformableTransformerEncoder(encoder_layer, num_encoder_layers)
        decoder_layer = DeformableCompositeTransformerDecoderLayer(d_model, dim_feedforward, dropout, activation,
                                                                   num_feature_levels, nhead, dec_n_points)
        self.decoder = DeformableCompositeTransformerDecoder(temp, decoder_layer, num_decoder_layers,
                                                             return_intermediate_dec, d_model)
        self.level_embed = nn.Parameter(torch.Tensor(num_feature_levels, d_model))
        # the detector hands its proposal heads over after construction
        self.bezier_coord_embed = None
        self.bezier_class_embed = None
        self.enc_output = nn.Linear(d_model, d_model)
        self.enc_output_norm = nn.LayerNorm(d_model)
        self.num_points = num_points

        # Bernstein basis of a cubic at num_points evenly spaced t: a plain tensor, not a buffer (as upstream)
        ts = torch.linspace(0, 1, num_points)
        self.bernstein_matrix = torch.stack(
            [torch.stack([t ** k * (1 - t) ** (3 - k) * n_over_k(3, k) for k in range(4)]) for t in ts])
        self._reset_parameters()

    def _reset_parameters(self):
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for m in self.modules():
            if isinstance(m, MSDeformAttn):
                m._reset_parameters()
        normal_(self.level_embed)

    def init_points_from_bezier_proposals(self, reference_bezier):
        """(bs, nq, 8) control points → (bs, nq, num_points, 2) points on each curve."""
        bz = reference_bezier.shape[0]
        initial_reference_points = reference_bezier.view(bz, self.num_proposals, 4, 2)
        return torch.matmul(upcast(self.bernstein_matrix.to(initial_reference_points.device)),
                            upcast(initial_reference_points))

    def gen_encoder_output_proposals(self, memory, memory_padding_mask, spatial_shapes):
        """One degenerate Bezier proposal per memory cell (all four control points at the cell centre),
        unactivated; padding and borders → inf."""
        N_, S_, C_ = memory.shape
        proposals = []
        _cur = 0
        for lvl, (H_, W_) in enumerate(spatial_shapes):
            mask_flatten_ = memory_padding_mask[:, _cur:(_cur + H_ * W_)].view(N_, H_, W_, 1)
            valid_H = torch.sum(~mask_flatten_[:, :, 0, 0], 1)
            valid_W = torch.sum(~mask_flatten_[:, 0, :, 0], 1)
            grid_y, grid_x = torch.meshgrid(torch.linspace(0, H_ - 1, H_, dtype=torch.float32, device=memory.device),
                                            torch.linspace(0, W_ - 1, W_, dtype=torch.float32, device=memory.device),
                                            indexing="ij")
            grid = torch.cat([grid_x.unsqueeze(-1), grid_y.unsqueeze(-1)], -1)
            scale = torch.cat([valid_W.unsqueeze(-1), valid_H.unsqueeze(-1)], 1).view(N_, 1, 1, 2)
            grid = (grid.unsqueeze(0).expand(N_, -1, -1, -1) + 0.5) / scale
            proposal = grid.repeat(1, 1, 1, 4)
            assert proposal.shape[-1] == 8
            proposals.append(proposal.view(N_, -1, 8))
            _cur += H_ * W_
        output_proposals = torch.cat(proposals, 1)
        valid = ((output_proposals > 0.01) & (output_proposals < 0.99)).all(-1, keepdim=True)
        output_proposals = torch.log(output_proposals / (1 - output_proposals))
        output_proposals = output_proposals.masked_fill(memory_padding_mask.unsqueeze(-1), float("inf"))
        output_proposals = output_proposals.masked_fill(~valid, float("inf"))
        output_memory = memory.masked_fill(memory_padding_mask.unsqueeze(-1), float(0))
        output_memory = output_memory.masked_fill(~valid, float(0))
        return self.enc_output_norm(self.enc_output(output_memory)), output_proposals

    def get_valid_ratio(self, mask):
        _, H, W = mask.shape
        valid_H = torch.sum(~mask[:, :, 0], 1)
        valid_W = torch.sum(~mask[:, 0, :], 1)
        return torch.stack([valid_W.float() / W, valid_H.float() / H], -1)

    def forward(self, srcs, masks, pos_embeds, query_embed):
        src_flatten, mask_flatten, lvl_pos_embed_flatten, spatial_shapes = [], [], [], []
        for lvl, (src, mask, pos_embed) in enumerate(zip(srcs, masks, pos_embeds)):
            bs, c, h, w = src.shape
            spatial_shapes.append((h, w))
            src_flatten.append(src.flatten(2).transpose(1, 2))
            mask_flatten.append(mask.flatten(1))
            lvl_pos_embed_flatten.append(pos_embed.flatten(2).transpose(1, 2) + self.level_embed[lvl].view(1, 1, -1))
        src_flatten = torch.cat(src_flatten, 1)
        mask_flatten = torch.cat(mask_flatten, 1)
        lvl_pos_embed_flatten = torch.cat(lvl_pos_embed_flatten, 1)
        spatial_shapes = torch.as_tensor(spatial_shapes, dtype=torch.long, device=src_flatten.device)
        level_start_index = torch.cat((spatial_shapes.new_zeros((1,)), spatial_shapes.prod(1).cumsum(0)[:-1]))
        valid_ratios = torch.stack([self.get_valid_ratio(m) for m in masks], 1)

        memory = self.encoder(src_flatten, spatial_shapes, level_start_index, valid_ratios, lvl_pos_embed_flatten,
                              mask_flatten)

        bs, _, c = memory.shape
        output_memory, output_proposals = self.gen_encoder_output_proposals(memory, mask_flatten, spatial_shapes)
        enc_outputs_class = self.bezier_class_embed(output_memory)
        enc_outputs_coord_unact = self.bezier_coord_embed(output_memory) + output_proposals

        # the top-K curves seed the point queries
        topk_proposals = torch.topk(enc_outputs_class[..., 0], self.num_proposals, dim=1)[1]
        topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1, topk_proposals.unsqueeze(-1).repeat(1, 1, 8))
        topk_coords_unact = topk_coords_unact.detach()
        reference_points = self.init_points_from_bezier_proposals(topk_coords_unact.sigmoid())
        init_reference_out = reference_points
        query_embed = query_embed.unsqueeze(0).expand(bs, -1, -1, -1)

        hs, inter_references = self.decoder(query_embed, reference_points, memory, spatial_shapes,
                                            level_start_index, valid_ratios, query_pos=None,
                                            src_padding_mask=mask_flatten)
        return hs, init_reference_out, inter_references, enc_outputs_class, enc_outputs_coord_unact


class DeformableCompositeTransformerDecoderLayer(nn.Module):
    def __init__(self, d_model=256, d_ffn=1024, dropout=0.1, activation="relu", n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.attn_intra = nn.MultiheadAttention(d_model, n_heads, dropout=dropout)
        self.norm_intra = nn.LayerNorm(d_model)
        self.dropout_intra = nn.Dropout(dropout)
        self.attn_inter = nn.MultiheadAttention(d_model, n_heads, dropout=dropout)
        self.dropout_inter = nn.Dropout(dropout)
        self.norm_inter = nn.LayerNorm(d_model)
        self.attn_cross = MSDeformAttn(d_model, n_levels, n_heads, n_points)
        self.dropout_cross = nn.Dropout(dropout)
        self.norm_cross = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.activation = _get_activation_fn(activation)
        self.dropout3 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.dropout4 = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(d_model)

    @staticmethod
    def with_pos_embed(tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward_ffn(self, tgt):
        tgt2 = self.linear2(self.dropout3(self.activation(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout4(tgt2))

    def forward(self, tgt, query_pos, reference_points, src, src_spatial_shapes, level_start_index,
                src_padding_mask=None):
        # tgt, query_pos: (bs, n_q, n_pts, dim)
        q = k = self.with_pos_embed(tgt, query_pos)
        tgt2 = self.attn_intra(q.flatten(0, 1).transpose(0, 1), k.flatten(0, 1).transpose(0, 1),
                               tgt.flatten(0, 1).transpose(0, 1))[0].transpose(0, 1).reshape(q.shape)
        tgt = self.norm_intra(tgt + self.dropout_intra(tgt2))

        q_inter = k_inter = tgt_inter = torch.swapdims(tgt, 1, 2)  # (bs, n_pts, n_q, dim)
        tgt2_inter = self.attn_inter(q_inter.flatten(0, 1).transpose(0, 1), k_inter.flatten(0, 1).transpose(0, 1),
                                     tgt_inter.flatten(0, 1).transpose(0, 1))[0].transpose(0, 1).reshape(
                                         q_inter.shape)
        tgt_inter = torch.swapdims(self.norm_inter(tgt_inter + self.dropout_inter(tgt2_inter)), 1, 2)

        if len(reference_points.shape) == 4:
            reference_points_loc = reference_points[:, :, None, :, :].repeat(1, 1, tgt_inter.shape[2], 1, 1)
        else:
            assert reference_points.shape[2] == tgt_inter.shape[2]
            reference_points_loc = reference_points
        tgt2 = self.attn_cross(self.with_pos_embed(tgt_inter, query_pos).flatten(1, 2),
                               reference_points_loc.flatten(1, 2), src, src_spatial_shapes, level_start_index,
                               src_padding_mask).reshape(tgt_inter.shape)
        tgt = self.norm_cross(tgt_inter + self.dropout_cross(tgt2))
        return self.forward_ffn(tgt)


class DeformableCompositeTransformerDecoder(nn.Module):
    def __init__(self, temp, decoder_layer, num_layers, return_intermediate=False, d_model=256):
        super().__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.return_intermediate = return_intermediate
        self.ctrl_point_coord = None  # set by the detector after construction (iterative refinement)
        self.ref_point_head = MLP(d_model, d_model, d_model, 2)
        self.temp = temp
        self.d_model = d_model

    def forward(self, tgt, reference_points, src, src_spatial_shapes, src_level_start_index, src_valid_ratios,
                query_pos=None, src_padding_mask=None):
        output = tgt  # (bs, n_q, n_pts, dim)
        assert query_pos is None and reference_points.shape[-1] == 2
        intermediate, intermediate_reference_points = [], []
        for lid, layer in enumerate(self.layers):
            # (bs, nq, n_pts, 2) -> (bs, nq, n_pts, n_levels, 2)
            reference_points_input = reference_points[:, :, :, None] * src_valid_ratios[:, None, None]
            query_pos = self.ref_point_head(
                gen_point_pos_embed(reference_points_input[:, :, :, 0, :], self.d_model, self.temp))
            output = layer(output, query_pos, reference_points_input, src, src_spatial_shapes,
                           src_level_start_index, src_padding_mask)
            if self.ctrl_point_coord is not None:
                tmp = self.ctrl_point_coord[lid](output)
                reference_points = (tmp + inverse_sigmoid(reference_points)).sigmoid().detach()
            if self.return_intermediate:
                intermediate.append(output)
                intermediate_reference_points.append(reference_points)
        if self.return_intermediate:
            return torch.stack(intermediate), torch.stack(intermediate_reference_points)
        return output, reference_points
