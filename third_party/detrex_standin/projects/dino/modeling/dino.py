import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from detectron2.modeling import detector_postprocess
from detectron2.structures import ImageList
from detrex.layers import MLP
from detrex.utils import inverse_sigmoid
from projects.deformable_detr.modeling import DeformableDETR


class DINO(nn.Module):
    """DINO at inference: two-stage query selection, per-layer class/box heads shared with the decoder, a label
    encoder for (training-time) denoising queries; detrex's list[dict] interface and top-k post-processing."""

    def __init__(self, backbone, position_embedding, neck, transformer, embed_dim, num_classes, num_queries,
                 criterion, pixel_mean=(123.675, 116.280, 103.530), pixel_std=(58.395, 57.120, 57.375),
                 aux_loss=True, select_box_nums_for_evaluation=300, device="cuda", dn_number=100,
                 label_noise_ratio=0.2, box_noise_scale=1.0):
        super().__init__()
        self.backbone = backbone
        self.position_embedding = position_embedding
        self.neck = neck
        self.num_queries = num_queries
        self.embed_dim = embed_dim
        self.transformer = transformer
        self.num_classes = num_classes
        self.aux_loss = aux_loss
        self.criterion = criterion
        self.label_enc = nn.Embedding(num_classes, embed_dim)
        self.dn_number = dn_number
        self.label_noise_ratio = label_noise_ratio
        self.box_noise_scale = box_noise_scale
        self.device = device
        mean = torch.Tensor(pixel_mean).to(device).view(3, 1, 1)
        std = torch.Tensor(pixel_std).to(device).view(3, 1, 1)
        self.normalizer = lambda x: (x - mean) / std

        class_embed = nn.Linear(embed_dim, num_classes)
        bbox_embed = MLP(embed_dim, embed_dim, 4, 3)
        class_embed.bias.data = torch.ones(num_classes) * -math.log((1 - 0.01) / 0.01)
        nn.init.constant_(bbox_embed.layers[-1].weight.data, 0)
        nn.init.constant_(bbox_embed.layers[-1].bias.data, 0)
        num_pred = transformer.decoder.num_layers + 1
        self.class_embed = nn.ModuleList(copy.deepcopy(class_embed) for _ in range(num_pred))
        self.bbox_embed = nn.ModuleList(copy.deepcopy(bbox_embed) for _ in range(num_pred))
        self.transformer.decoder.class_embed = self.class_embed
        self.transformer.decoder.bbox_embed = self.bbox_embed
        for _, layer in self.neck.named_modules():
            if isinstance(layer, nn.Conv2d):
                nn.init.xavier_uniform_(layer.weight, gain=1)
                nn.init.constant_(layer.bias, 0)
        self.select_box_nums_for_evaluation = select_box_nums_for_evaluation

    def forward(self, batched_inputs):
        images = self.preprocess_image(batched_inputs)
        if self.training:
            raise NotImplementedError("the stand-in is inference-only (no denoising, no criterion)")
        batch_size, _, H, W = images.tensor.shape
        img_masks = images.tensor.new_ones(batch_size, H, W)
        for img_id in range(batch_size):
            img_h, img_w = images.image_sizes[img_id]
            img_masks[img_id, :(img_h - 1), :(img_w - 1)] = 0

        features = self.backbone(images.tensor)
        multi_level_feats = self.neck(features)
        multi_level_masks, multi_level_position_embeddings = [], []
        for feat in multi_level_feats:
            multi_level_masks.append(F.interpolate(img_masks[None], size=feat.shape[-2:]).to(torch.bool).squeeze(0))
            multi_level_position_embeddings.append(self.position_embedding(multi_level_masks[-1]))

        query_embeds = (None, None)  # no denoising queries at inference
        inter_states, init_reference, inter_references, enc_state, enc_reference = self.transformer(
            multi_level_feats, multi_level_masks, multi_level_position_embeddings, query_embeds,
            attn_masks=[None, None])
        inter_states[0] += self.label_enc.weight[0, 0] * 0.0  # upstream's hack for distributed training

        outputs_classes, outputs_coords = [], []
        for lvl in range(inter_states.shape[0]):
            reference = inverse_sigmoid(init_reference if lvl == 0 else inter_references[lvl - 1])
            outputs_classes.append(self.class_embed[lvl](inter_states[lvl]))
            outputs_coords.append((self.bbox_embed[lvl](inter_states[lvl]) + reference).sigmoid())
        outputs_class = torch.stack(outputs_classes)
        outputs_coord = torch.stack(outputs_coords)

        results = self.inference(outputs_class[-1], outputs_coord[-1], images.image_sizes)
        processed = []
        for result, input_per_image, image_size in zip(results, batched_inputs, images.image_sizes):
            height = input_per_image.get("height", image_size[0])
            width = input_per_image.get("width", image_size[1])
            processed.append({"instances": detector_postprocess(result, height, width)})
        return processed

    inference = DeformableDETR.inference

    def preprocess_image(self, batched_inputs):
        images = [self.normalizer(x["image"].to(self.device)) for x in batched_inputs]
        return ImageList.from_tensors(images)
