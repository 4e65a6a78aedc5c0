import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from detectron2.modeling import detector_postprocess
from detectron2.structures import Boxes, ImageList, Instances
from detrex.layers import MLP, box_cxcywh_to_xyxy, box_xyxy_to_cxcywh
from detrex.utils import inverse_sigmoid


class DeformableDETR(nn.Module):
    """Deformable DETR (optionally two-stage, with iterative box refinement), detrex's way: list[dict] in,
    list[{"instances": Instances}] out, top-k over queries × classes of the sigmoid scores."""

    def __init__(self, backbone, position_embedding, neck, transformer, embed_dim, num_classes, num_queries,
                 criterion, pixel_mean, pixel_std, aux_loss=True, with_box_refine=False, as_two_stage=False,
                 select_box_nums_for_evaluation=100, device="cuda"):
        super().__init__()
        self.backbone = backbone
        self.position_embedding = position_embedding
        self.neck = neck
        self.transformer = transformer
        self.num_queries = num_queries
        self.num_classes = num_classes
        self.aux_loss = aux_loss
        self.with_box_refine = with_box_refine
        self.as_two_stage = as_two_stage
        self.criterion = criterion
        self.select_box_nums_for_evaluation = select_box_nums_for_evaluation
        if not as_two_stage:
            self.query_embedding = nn.Embedding(num_queries, embed_dim * 2)

        # the normaliser lives in a lambda, not in buffers (as upstream)
        self.device = device
        mean = torch.Tensor(pixel_mean).to(device).view(3, 1, 1)
        std = torch.Tensor(pixel_std).to(device).view(3, 1, 1)
        self.normalizer = lambda x: (x - mean) / std

        class_embed = nn.Linear(embed_dim, num_classes)
        bbox_embed = MLP(embed_dim, embed_dim, 4, 3)
        class_embed.bias.data = torch.ones(num_classes) * -math.log((1 - 0.01) / 0.01)
        nn.init.constant_(bbox_embed.layers[-1].weight.data, 0)
        nn.init.constant_(bbox_embed.layers[-1].bias.data, 0)
        # two-stage: the last class/box head scores the encoder's proposals
        num_pred = transformer.decoder.num_layers + (1 if as_two_stage else 0)
        if with_box_refine:
            self.class_embed = nn.ModuleList(copy.deepcopy(class_embed) for _ in range(num_pred))
            self.bbox_embed = nn.ModuleList(copy.deepcopy(bbox_embed) for _ in range(num_pred))
            nn.init.constant_(self.bbox_embed[0].layers[-1].bias.data[2:], -2.0)
            self.transformer.decoder.bbox_embed = self.bbox_embed
        else:
            nn.init.constant_(bbox_embed.layers[-1].bias.data[2:], -2.0)
            self.class_embed = nn.ModuleList([class_embed for _ in range(num_pred)])
            self.bbox_embed = nn.ModuleList([bbox_embed for _ in range(num_pred)])
            self.transformer.decoder.bbox_embed = None
        if as_two_stage:
            self.transformer.decoder.class_embed = self.class_embed
            for box_embed in self.bbox_embed:
                nn.init.constant_(box_embed.layers[-1].bias.data[2:], 0.0)
        for _, layer in self.neck.named_modules():
            if isinstance(layer, nn.Conv2d):
                nn.init.xavier_uniform_(layer.weight, gain=1)
                nn.init.constant_(layer.bias, 0)

    def forward(self, batched_inputs):
        images = self.preprocess_image(batched_inputs)
        batch_size, _, H, W = images.tensor.shape
        img_masks = images.tensor.new_ones(batch_size, H, W)
        for img_id in range(batch_size):  # padding masks from the padded ImageList (upstream's eval-time rule)
            if self.training:
                img_h, img_w = batched_inputs[img_id]["instances"].image_size
                img_masks[img_id, :img_h, :img_w] = 0
            else:
                img_h, img_w = images.image_sizes[img_id]
                img_masks[img_id, :(img_h - 1), :(img_w - 1)] = 0

        features = self.backbone(images.tensor)
        multi_level_feats = self.neck(features)
        multi_level_masks, multi_level_position_embeddings = [], []
        for feat in multi_level_feats:
            multi_level_masks.append(F.interpolate(img_masks[None], size=feat.shape[-2:]).to(torch.bool).squeeze(0))
            multi_level_position_embeddings.append(self.position_embedding(multi_level_masks[-1]))

        query_embeds = None if self.as_two_stage else self.query_embedding.weight
        inter_states, init_reference, inter_references, enc_class, enc_coord_unact = self.transformer(
            multi_level_feats, multi_level_masks, multi_level_position_embeddings, query_embeds)

        outputs_classes, outputs_coords = [], []
        for lvl in range(inter_states.shape[0]):
            reference = inverse_sigmoid(init_reference if lvl == 0 else inter_references[lvl - 1])
            outputs_class = self.class_embed[lvl](inter_states[lvl])
            tmp = self.bbox_embed[lvl](inter_states[lvl])
            if reference.shape[-1] == 4:
                tmp += reference
            else:
                tmp[..., :2] += reference
            outputs_classes.append(outputs_class)
            outputs_coords.append(tmp.sigmoid())
        outputs_class = torch.stack(outputs_classes)
        outputs_coord = torch.stack(outputs_coords)

        if self.training:
            raise NotImplementedError("the stand-in is inference-only (no criterion)")
        results = self.inference(outputs_class[-1], outputs_coord[-1], images.image_sizes)
        processed = []
        for result, input_per_image, image_size in zip(results, batched_inputs, images.image_sizes):
            height = input_per_image.get("height", image_size[0])
            width = input_per_image.get("width", image_size[1])
            processed.append({"instances": detector_postprocess(result, height, width)})
        return processed

    def inference(self, box_cls, box_pred, image_sizes):
        """Top-k over queries × classes of the sigmoid scores; boxes scaled to each image's own size."""
        assert len(box_cls) == len(image_sizes)
        prob = box_cls.sigmoid()
        topk_values, topk_indexes = torch.topk(prob.view(box_cls.shape[0], -1), self.select_box_nums_for_evaluation,
                                               dim=1)
        topk_boxes = torch.div(topk_indexes, box_cls.shape[2], rounding_mode="floor")
        labels = topk_indexes % box_cls.shape[2]
        boxes = torch.gather(box_pred, 1, topk_boxes.unsqueeze(-1).repeat(1, 1, 4))
        results = []
        for scores_i, labels_i, boxes_i, image_size in zip(topk_values, labels, boxes, image_sizes):
            result = Instances(image_size)
            result.pred_boxes = Boxes(box_cxcywh_to_xyxy(boxes_i))
            result.pred_boxes.scale(scale_x=image_size[1], scale_y=image_size[0])
            result.scores = scores_i
            result.pred_classes = labels_i
            results.append(result)
        return results

    def preprocess_image(self, batched_inputs):
        images = [self.normalizer(x["image"].to(self.device)) for x in batched_inputs]
        return ImageList.from_tensors(images)

    def prepare_targets(self, targets):
        new_targets = []
        for t in targets:
            h, w = t.image_size
            scale = torch.as_tensor([w, h, w, h], dtype=torch.float, device=self.device)
            new_targets.append({"labels": t.gt_classes, "boxes": box_xyxy_to_cxcywh(t.gt_boxes.tensor / scale)})
        return new_targets
