"""TESTR: input projections, the deformable transformer and the class / control-point / text heads."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from testr.layers.deformable_transformer import DeformableTransformer
from testr.layers.pos_encoding import PositionalEncoding1D
from testr.utils.misc import NestedTensor, inverse_sigmoid_offset, nested_tensor_from_tensor_list, sigmoid_offset


class MLP(nn.Module):
    """A few linear layers with ReLU between them."""

    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class TESTR(nn.Module):
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
        # crossed on purpose: upstream reads the decoder's point count from ENC_N_POINTS and vice versa
        self.dec_n_points = t.ENC_N_POINTS
        self.enc_n_points = t.DEC_N_POINTS
        self.num_proposals = t.NUM_QUERIES
        self.pos_embed_scale = t.POSITION_EMBEDDING_SCALE
        self.num_ctrl_points = t.NUM_CTRL_POINTS
        self.num_classes = 1
        self.max_text_len = t.NUM_CHARS
        self.voc_size = t.VOC_SIZE
        # beziers may leave the image, so their sigmoid is widened; polygons stay in [0, 1]
        self.sigmoid_offset = not t.USE_POLYGON

        self.text_pos_embed = PositionalEncoding1D(self.d_model, normalize=True, scale=self.pos_embed_scale)

        self.transformer = DeformableTransformer(
            d_model=self.d_model, nhead=self.nhead, num_encoder_layers=self.num_encoder_layers,
            num_decoder_layers=self.num_decoder_layers, dim_feedforward=self.dim_feedforward,
            dropout=self.dropout, activation=self.activation, return_intermediate_dec=self.return_intermediate_dec,
            num_feature_levels=self.num_feature_levels, dec_n_points=self.dec_n_points,
            enc_n_points=self.enc_n_points, num_proposals=self.num_proposals,
            slot_references=t.TEXT_SLOT_REFERENCES,
        )
        self.ctrl_point_class = nn.Linear(self.d_model, self.num_classes)
        self.ctrl_point_coord = MLP(self.d_model, self.d_model, 2, 3)
        self.bbox_coord = MLP(self.d_model, self.d_model, 4, 3)
        self.bbox_class = nn.Linear(self.d_model, self.num_classes)
        self.text_class = nn.Linear(self.d_model, self.voc_size + 1)

        # learned queries shared by all proposals
        self.ctrl_point_embed = nn.Embedding(self.num_ctrl_points, self.d_model)
        self.text_embed = nn.Embedding(self.max_text_len, self.d_model)

        # the backbone's last three levels (res3..res5: 512, 1024, 2048 channels on a ResNet-50; upstream writes
        # those numbers, read here from the backbone so narrower ones fit), plus strided extra levels
        if self.num_feature_levels > 1:
            num_channels = backbone[0].channels[-3:]
            input_proj_list = []
            for in_channels in num_channels:
                input_proj_list.append(nn.Sequential(
                    nn.Conv2d(in_channels, self.d_model, kernel_size=1),
                    nn.GroupNorm(32, self.d_model),
                ))
            for _ in range(self.num_feature_levels - len(num_channels)):
                input_proj_list.append(nn.Sequential(
                    nn.Conv2d(in_channels, self.d_model, kernel_size=3, stride=2, padding=1),
                    nn.GroupNorm(32, self.d_model),
                ))
                in_channels = self.d_model
            self.input_proj = nn.ModuleList(input_proj_list)
        else:
            self.input_proj = nn.ModuleList([nn.Sequential(
                nn.Conv2d(backbone[0].channels[-1], self.d_model, kernel_size=1),
                nn.GroupNorm(32, self.d_model),
            )])
        self.aux_loss = t.AUX_LOSS

        prior_prob = 0.01
        bias_value = -np.log((1 - prior_prob) / prior_prob)
        self.ctrl_point_class.bias.data = torch.ones(self.num_classes) * bias_value
        self.bbox_class.bias.data = torch.ones(self.num_classes) * bias_value
        nn.init.constant_(self.ctrl_point_coord.layers[-1].weight.data, 0)
        nn.init.constant_(self.ctrl_point_coord.layers[-1].bias.data, 0)
        for proj in self.input_proj:
            nn.init.xavier_uniform_(proj[0].weight, gain=1)
            nn.init.constant_(proj[0].bias, 0)

        # one head per decoder layer, all the same module (the state dict lists it once per layer)
        num_pred = self.num_decoder_layers
        self.ctrl_point_class = nn.ModuleList([self.ctrl_point_class for _ in range(num_pred)])
        self.ctrl_point_coord = nn.ModuleList([self.ctrl_point_coord for _ in range(num_pred)])
        self.transformer.decoder.bbox_embed = None

        nn.init.constant_(self.bbox_coord.layers[-1].bias.data[2:], 0.0)
        # the encoder's proposal heads (two-stage)
        self.transformer.bbox_class_embed = self.bbox_class
        self.transformer.bbox_embed = self.bbox_coord

        self.to(self.device)

    def forward(self, samples):
        """samples: detectron2 ImageList (tensor + image_sizes), as TransformerDetector passes it.

        Returns a dict:
          pred_logits       (B, Q, n_ctrl, 1)       per-control-point class logits
          pred_ctrl_points  (B, Q, n_ctrl, 2)       (x, y) relative to the image's unpadded size
          pred_texts        (B, Q, n_chars, voc+1)  character logits
          enc_outputs       encoder proposals' logits and boxes
        """
        if isinstance(samples, (list, torch.Tensor)):
            samples = nested_tensor_from_tensor_list(samples)
        features, pos = self.backbone(samples)

        if self.num_feature_levels == 1:
            features = [features[-1]]
            pos = [pos[-1]]

        srcs = []
        masks = []
        for lvl, feat in enumerate(features):
            src, mask = feat.decompose()
            srcs.append(self.input_proj[lvl](src))
            masks.append(mask)
            assert mask is not None
        if self.num_feature_levels > len(srcs):
            _len_srcs = len(srcs)
            for lvl in range(_len_srcs, self.num_feature_levels):
                if lvl == _len_srcs:
                    src = self.input_proj[lvl](features[-1].tensors)
                else:
                    src = self.input_proj[lvl](srcs[-1])
                # the extra level's mask: nearest-resized from the finest level's
                mask = F.interpolate(masks[0][None].float(), size=src.shape[-2:]).to(torch.bool)[0]
                pos_l = self.backbone[1](NestedTensor(src, mask)).to(src.dtype)
                srcs.append(src)
                masks.append(mask)
                pos.append(pos_l)

        # (n_points, C) -> (n_proposals, n_points, C)
        ctrl_point_embed = self.ctrl_point_embed.weight[None, ...].repeat(self.num_proposals, 1, 1)
        text_pos_embed = self.text_pos_embed(self.text_embed.weight)[None, ...].repeat(self.num_proposals, 1, 1)
        text_embed = self.text_embed.weight[None, ...].repeat(self.num_proposals, 1, 1)

        hs, hs_text, init_reference, inter_references, enc_outputs_class, enc_outputs_coord_unact = \
            self.transformer(srcs, masks, pos, ctrl_point_embed, text_embed, text_pos_embed, text_mask=None)

        outputs_classes = []
        outputs_coords = []
        outputs_texts = []
        for lvl in range(hs.shape[0]):
            reference = init_reference if lvl == 0 else inter_references[lvl - 1]
            reference = inverse_sigmoid_offset(reference, offset=self.sigmoid_offset)
            outputs_class = self.ctrl_point_class[lvl](hs[lvl])
            # control points are offsets from the proposal's centre, in logit space
            tmp = self.ctrl_point_coord[lvl](hs[lvl])
            if reference.shape[-1] == 2:
                tmp += reference[:, :, None, :]
            else:
                assert reference.shape[-1] == 4
                tmp += reference[:, :, None, :2]
            outputs_texts.append(self.text_class(hs_text[lvl]))
            outputs_classes.append(outputs_class)
            outputs_coords.append(sigmoid_offset(tmp, offset=self.sigmoid_offset))
        outputs_class = torch.stack(outputs_classes)
        outputs_coord = torch.stack(outputs_coords)
        outputs_text = torch.stack(outputs_texts)

        out = {"pred_logits": outputs_class[-1], "pred_ctrl_points": outputs_coord[-1],
               "pred_texts": outputs_text[-1]}
        if self.aux_loss:
            out["aux_outputs"] = self._set_aux_loss(outputs_class, outputs_coord, outputs_text)
        out["enc_outputs"] = {"pred_logits": enc_outputs_class, "pred_boxes": enc_outputs_coord_unact.sigmoid()}
        if self.training:  # where each query's text branch sampled (TESTR never refines them: every layer's are the
            out["pred_references"] = inter_references[-1]  # encoder's top-k): the matcher may prefer words there
            out["char_features"] = srcs[0]  # the finest projected map, for LOSS.CHAR_CENTRE_WEIGHT
        return out

    @torch.jit.unused
    def _set_aux_loss(self, outputs_class, outputs_coord, outputs_text):
        return [{"pred_logits": a, "pred_ctrl_points": b, "pred_texts": c}
                for a, b, c in zip(outputs_class[:-1], outputs_coord[:-1], outputs_text[:-1])]
