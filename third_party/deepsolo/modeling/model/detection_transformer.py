"""DeepSolo: input projections, the deformable transformer, the Bezier proposal heads and the per-point class,
coordinate, character and boundary heads."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepsolo.layers.deformable_transformer import DeformableTransformer
from deepsolo.modeling.model.utils import MLP
from deepsolo.utils.misc import NestedTensor, inverse_sigmoid_offset, nested_tensor_from_tensor_list, sigmoid_offset


class DETECTION_TRANSFORMER(nn.Module):
    def __init__(self, cfg, backbone):
        super().__init__()
        self.device = torch.device(cfg.MODEL.DEVICE)
        self.backbone = backbone

        t = cfg.MODEL.TRANSFORMER
        self.d_model = t.HIDDEN_DIM
        self.nhead = t.NHEADS
        self.num_encoder_layers = t.ENC_LAYERS
        self.num_decoder_layers = t.DEC_LAYERS
        self.dim_feedforward = t.DIM_FEEDFORWARD
        self.dropout = t.DROPOUT
        self.activation = "relu"
        self.return_intermediate_dec = True
        self.num_feature_levels = t.NUM_FEATURE_LEVELS
        self.dec_n_points = t.ENC_N_POINTS  # crossed over as upstream does (both 4 in every released config)
        self.enc_n_points = t.DEC_N_POINTS
        self.pos_embed_scale = t.POSITION_EMBEDDING_SCALE
        self.num_classes = 1  # text or not
        self.voc_size = t.VOC_SIZE
        self.sigmoid_offset = False
        self.num_proposals = t.NUM_QUERIES
        self.num_points = t.NUM_POINTS
        # one content query per point of every proposal (not shared across proposals)
        self.point_embed = nn.Embedding(self.num_proposals * self.num_points, self.d_model)

        self.transformer = DeformableTransformer(
            temp=t.TEMPERATURE, d_model=self.d_model, nhead=self.nhead, num_encoder_layers=self.num_encoder_layers,
            num_decoder_layers=self.num_decoder_layers, dim_feedforward=self.dim_feedforward, dropout=self.dropout,
            activation=self.activation, return_intermediate_dec=self.return_intermediate_dec,
            num_feature_levels=self.num_feature_levels, dec_n_points=self.dec_n_points,
            enc_n_points=self.enc_n_points, num_proposals=self.num_proposals, num_points=self.num_points)

        if self.num_feature_levels > 1:
            if cfg.MODEL.BACKBONE.NAME == "build_swin_backbone":
                num_channels = [192, 384, 768]
            elif cfg.MODEL.BACKBONE.NAME == "build_vitaev2_backbone":
                num_channels = [128, 256, 512]
            else:
                num_channels = [512, 1024, 2048]
            input_proj_list = [nn.Sequential(nn.Conv2d(ch, self.d_model, kernel_size=1),
                                             nn.GroupNorm(32, self.d_model)) for ch in num_channels]
            in_channels = num_channels[-1]
            for _ in range(self.num_feature_levels - len(num_channels)):
                input_proj_list.append(nn.Sequential(
                    nn.Conv2d(in_channels, self.d_model, kernel_size=3, stride=2, padding=1),
                    nn.GroupNorm(32, self.d_model)))
                in_channels = self.d_model
            self.input_proj = nn.ModuleList(input_proj_list)
        else:
            self.input_proj = nn.ModuleList([nn.Sequential(nn.Conv2d(2048, self.d_model, kernel_size=1),
                                                           nn.GroupNorm(32, self.d_model))])
        for proj in self.input_proj:
            nn.init.xavier_uniform_(proj[0].weight, gain=1)
            nn.init.constant_(proj[0].bias, 0)
        self.aux_loss = t.AUX_LOSS

        # Bezier centre-line proposals after the encoder: (x0, y0, ..., x3, y3)
        self.bezier_proposal_coord = MLP(self.d_model, self.d_model, 8, 3)
        self.bezier_proposal_class = nn.Linear(self.d_model, self.num_classes)
        # per-point heads after the decoder
        self.ctrl_point_coord = MLP(self.d_model, self.d_model, 2, 3)
        self.ctrl_point_class = nn.Linear(self.d_model, self.num_classes)
        self.ctrl_point_text = nn.Linear(self.d_model, self.voc_size + 1)  # a character (or none) per point
        self.boundary_head_on = t.BOUNDARY_HEAD
        if self.boundary_head_on:
            self.boundary_offset = MLP(self.d_model, self.d_model, 4, 3)  # upper and lower boundary points

        bias_value = -np.log((1 - 0.01) / 0.01)
        self.bezier_proposal_class.bias.data = torch.ones(self.num_classes) * bias_value
        self.ctrl_point_class.bias.data = torch.ones(self.num_classes) * bias_value
        self.ctrl_point_text.bias.data = torch.ones(self.voc_size + 1) * bias_value
        nn.init.constant_(self.bezier_proposal_coord.layers[-1].weight.data, 0)
        nn.init.constant_(self.bezier_proposal_coord.layers[-1].bias.data, 0)
        self.transformer.bezier_coord_embed = self.bezier_proposal_coord
        self.transformer.bezier_class_embed = self.bezier_proposal_class
        nn.init.constant_(self.ctrl_point_coord.layers[-1].weight.data, 0)
        nn.init.constant_(self.ctrl_point_coord.layers[-1].bias.data, 0)
        if self.boundary_head_on:
            nn.init.constant_(self.boundary_offset.layers[-1].weight.data, 0)
            nn.init.constant_(self.boundary_offset.layers[-1].bias.data, 0)

        # one head shared by every decoder layer, listed once per layer (so the state dict has one entry per layer)
        num_pred = self.num_decoder_layers
        self.ctrl_point_coord = nn.ModuleList([self.ctrl_point_coord for _ in range(num_pred)])
        self.ctrl_point_class = nn.ModuleList([self.ctrl_point_class for _ in range(num_pred)])
        self.ctrl_point_text = nn.ModuleList([self.ctrl_point_text for _ in range(num_pred)])
        if self.boundary_head_on:
            self.boundary_offset = nn.ModuleList([self.boundary_offset for _ in range(num_pred)])
        self.transformer.decoder.ctrl_point_coord = self.ctrl_point_coord
        self.to(self.device)

    def forward(self, samples: NestedTensor):
        """samples: an ImageList-like (``.tensor`` [N, 3, H, W], ``.image_sizes``) or a list of images. Returns
        pred_logits (N, K, P, 1), pred_text_logits (N, K, P, voc + 1), pred_ctrl_points (N, K, P, 2) and
        pred_bd_points (N, K, P, 4) or None, points in [0, 1] of the padded input."""
        if isinstance(samples, (list, torch.Tensor)):
            samples = nested_tensor_from_tensor_list(samples)
        features, pos = self.backbone(samples)

        srcs, masks = [], []
        for lvl, feat in enumerate(features):
            src, mask = feat.decompose()
            srcs.append(self.input_proj[lvl](src))
            masks.append(mask)
            assert mask is not None
        if self.num_feature_levels > len(srcs):
            _len_srcs = len(srcs)
            for lvl in range(_len_srcs, self.num_feature_levels):
                src = self.input_proj[lvl](features[-1].tensors if lvl == _len_srcs else srcs[-1])
                mask = F.interpolate(masks[0][None].float(), size=src.shape[-2:]).to(torch.bool)[0]
                pos_l = self.backbone[1](NestedTensor(src, mask)).to(src.dtype)
                srcs.append(src)
                masks.append(mask)
                pos.append(pos_l)

        point_embed = self.point_embed.weight.reshape((self.num_proposals, self.num_points, self.d_model))
        hs, init_reference, inter_references, enc_outputs_class, enc_outputs_coord_unact = self.transformer(
            srcs, masks, pos, point_embed)

        outputs_texts, outputs_coords, outputs_classes, outputs_bd_coords = [], [], [], []
        for lvl in range(hs.shape[0]):
            reference = init_reference if lvl == 0 else inter_references[lvl - 1]
            reference = inverse_sigmoid_offset(reference, offset=self.sigmoid_offset)
            outputs_class = self.ctrl_point_class[lvl](hs[lvl])
            outputs_text = self.ctrl_point_text[lvl](hs[lvl])
            tmp = self.ctrl_point_coord[lvl](hs[lvl])
            if self.boundary_head_on:
                tmp_bd = self.boundary_offset[lvl](hs[lvl])
            if reference.shape[-1] != 2:
                raise NotImplementedError
            tmp += reference
            if self.boundary_head_on:
                tmp_bd += reference.repeat(1, 1, 1, 2)
                outputs_bd_coords.append(sigmoid_offset(tmp_bd, offset=self.sigmoid_offset))
            outputs_classes.append(outputs_class)
            outputs_texts.append(outputs_text)
            outputs_coords.append(sigmoid_offset(tmp, offset=self.sigmoid_offset))
        outputs_class = torch.stack(outputs_classes)
        outputs_text = torch.stack(outputs_texts)
        outputs_coord = torch.stack(outputs_coords)
        outputs_bd_coord = torch.stack(outputs_bd_coords) if self.boundary_head_on else None

        out = {"pred_logits": outputs_class[-1], "pred_text_logits": outputs_text[-1],
               "pred_ctrl_points": outputs_coord[-1],
               "pred_bd_points": outputs_bd_coord[-1] if self.boundary_head_on else None}
        if self.aux_loss:
            out["aux_outputs"] = self._set_aux_loss(outputs_class, outputs_text, outputs_coord, outputs_bd_coord)
        out["enc_outputs"] = {"pred_logits": enc_outputs_class, "pred_beziers": enc_outputs_coord_unact.sigmoid()}
        return out

    @torch.jit.unused
    def _set_aux_loss(self, outputs_class, outputs_text, outputs_coord, outputs_bd_coord):
        names = ("pred_logits", "pred_text_logits", "pred_ctrl_points", "pred_bd_points")
        per_layer = [outputs_class[:-1], outputs_text[:-1], outputs_coord[:-1]]
        if outputs_bd_coord is not None:
            per_layer.append(outputs_bd_coord[:-1])
        return [dict(zip(names, values)) for values in zip(*per_layer)]
