"""DPText-DETR: input projections, the deformable transformer and the per-point class / coordinate heads."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dptext.layers.deformable_transformer import DeformableTransformer_Det
from dptext.utils.misc import NestedTensor, inverse_sigmoid_offset, nested_tensor_from_tensor_list, sigmoid_offset

from .utils import MLP


class DPText_DETR(nn.Module):
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
        self.num_proposals = t.NUM_QUERIES
        self.pos_embed_scale = t.POSITION_EMBEDDING_SCALE
        self.num_ctrl_points = t.NUM_CTRL_POINTS
        self.num_classes = 1  # text
        self.sigmoid_offset = not t.USE_POLYGON
        self.epqm = t.EPQM
        self.efsa = t.EFSA

        self.ctrl_point_embed = nn.Embedding(self.num_ctrl_points, self.d_model)
        self.transformer = DeformableTransformer_Det(
            d_model=self.d_model, nhead=self.nhead, num_encoder_layers=self.num_encoder_layers,
            num_decoder_layers=self.num_decoder_layers, dim_feedforward=self.dim_feedforward, dropout=self.dropout,
            activation=self.activation, return_intermediate_dec=self.return_intermediate_dec,
            num_feature_levels=self.num_feature_levels, dec_n_points=self.dec_n_points,
            enc_n_points=self.enc_n_points, num_proposals=self.num_proposals, num_ctrl_points=self.num_ctrl_points,
            epqm=self.epqm, efsa=self.efsa)
        self.ctrl_point_class = nn.Linear(self.d_model, self.num_classes)
        self.ctrl_point_coord = MLP(self.d_model, self.d_model, 2, 3)
        self.bbox_coord = MLP(self.d_model, self.d_model, 4, 3)
        self.bbox_class = nn.Linear(self.d_model, self.num_classes)

        if self.num_feature_levels > 1:
            num_channels = [512, 1024, 2048]  # ResNet res3-res5, fixed upstream
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
        self.aux_loss = t.AUX_LOSS

        bias_value = -np.log((1 - 0.01) / 0.01)
        self.ctrl_point_class.bias.data = torch.ones(self.num_classes) * bias_value
        self.bbox_class.bias.data = torch.ones(self.num_classes) * bias_value
        nn.init.constant_(self.ctrl_point_coord.layers[-1].weight.data, 0)
        nn.init.constant_(self.ctrl_point_coord.layers[-1].bias.data, 0)
        for proj in self.input_proj:
            nn.init.xavier_uniform_(proj[0].weight, gain=1)
            nn.init.constant_(proj[0].bias, 0)

        # one head shared by every decoder layer, listed once per layer (so the state dict has one entry per layer)
        num_pred = self.num_decoder_layers
        self.ctrl_point_class = nn.ModuleList([self.ctrl_point_class for _ in range(num_pred)])
        self.ctrl_point_coord = nn.ModuleList([self.ctrl_point_coord for _ in range(num_pred)])
        if self.epqm:
            self.transformer.decoder.ctrl_point_coord = self.ctrl_point_coord
        self.transformer.decoder.bbox_embed = None
        nn.init.constant_(self.bbox_coord.layers[-1].bias.data[2:], 0.0)
        self.transformer.bbox_class_embed = self.bbox_class
        self.transformer.bbox_embed = self.bbox_coord
        self.to(self.device)

    def forward(self, samples: NestedTensor):
        """samples: an ImageList-like (``.tensor`` [N, 3, H, W], ``.image_sizes``) or a list of images.
        Returns pred_logits (N, K, n_pts, 1) and pred_ctrl_points (N, K, n_pts, 2) in [0, 1] of the padded input."""
        if isinstance(samples, (list, torch.Tensor)):
            samples = nested_tensor_from_tensor_list(samples)
        features, pos = self.backbone(samples)
        if self.num_feature_levels == 1:
            raise NotImplementedError

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

        # (n_pts, dim) -> (n_q, n_pts, dim): the same content queries for every proposal
        ctrl_point_embed = self.ctrl_point_embed.weight[None, ...].repeat(self.num_proposals, 1, 1)
        hs, init_reference, inter_references, enc_outputs_class, enc_outputs_coord_unact = self.transformer(
            srcs, masks, pos, ctrl_point_embed)

        outputs_classes, outputs_coords = [], []
        for lvl in range(hs.shape[0]):
            reference = init_reference if lvl == 0 else inter_references[lvl - 1]
            reference = inverse_sigmoid_offset(reference, offset=self.sigmoid_offset)
            outputs_class = self.ctrl_point_class[lvl](hs[lvl])
            tmp = self.ctrl_point_coord[lvl](hs[lvl])
            if reference.shape[-1] == 2:
                if self.epqm:
                    tmp += reference
                else:
                    tmp += reference[:, :, None, :]
            else:
                assert reference.shape[-1] == 4
                if self.epqm:
                    tmp += reference[..., :2]
                else:
                    tmp += reference[:, :, None, :2]
            outputs_classes.append(outputs_class)
            outputs_coords.append(sigmoid_offset(tmp, offset=self.sigmoid_offset))
        outputs_class = torch.stack(outputs_classes)
        outputs_coord = torch.stack(outputs_coords)

        out = {"pred_logits": outputs_class[-1], "pred_ctrl_points": outputs_coord[-1]}
        if self.aux_loss:
            out["aux_outputs"] = self._set_aux_loss(outputs_class, outputs_coord)
        out["enc_outputs"] = {"pred_logits": enc_outputs_class, "pred_boxes": enc_outputs_coord_unact.sigmoid()}
        return out

    @torch.jit.unused
    def _set_aux_loss(self, outputs_class, outputs_coord):
        return [{"pred_logits": a, "pred_ctrl_points": b} for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
