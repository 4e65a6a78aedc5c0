"""TESTR's detectron2 meta-architecture: image batching, padding masks, inference and rescaling; in training mode,
the targets from the mapper's Instances and the weighted losses (testr/modeling/testr/criterion.py)."""
from typing import List

import numpy as np
import torch
from torch import nn
from torchvision.ops import box_convert

from detectron2.modeling import build_backbone
from detectron2.modeling.meta_arch.build import META_ARCH_REGISTRY
from detectron2.structures import ImageList, Instances

from testr.layers.pos_encoding import PositionalEncoding2D
from testr.modeling.testr.criterion import SetCriterion, char_centre_loss
from testr.modeling.testr.models import TESTR
from testr.utils.misc import NestedTensor


class Joiner(nn.Sequential):
    """[0] the masked backbone, [1] the 2-D position encoding: features and their encodings per level."""

    def __init__(self, backbone, position_embedding):
        super().__init__(backbone, position_embedding)

    def forward(self, tensor_list):
        xs = self[0](tensor_list)
        out: List[NestedTensor] = []
        pos = []
        for _, x in xs.items():
            out.append(x)
            pos.append(self[1](x).to(x.tensors.dtype))
        return out, pos


class MaskedBackbone(nn.Module):
    """A detectron2 backbone whose outputs carry padding masks (True on padding)."""

    def __init__(self, cfg):
        super().__init__()
        self.backbone = build_backbone(cfg)
        backbone_shape = self.backbone.output_shape()
        self.feature_strides = [backbone_shape[f].stride for f in backbone_shape.keys()]
        self.channels = [backbone_shape[f].channels for f in backbone_shape.keys()]
        self.num_channels = self.channels[-1]

    def forward(self, images):
        features = self.backbone(images.tensor)
        masks = self.mask_out_padding(
            [features_per_level.shape for features_per_level in features.values()],
            images.image_sizes,
            images.tensor.device,
        )
        assert len(features) == len(masks)
        for i, k in enumerate(features.keys()):
            features[k] = NestedTensor(features[k], masks[i])
        return features

    def mask_out_padding(self, feature_shapes, image_sizes, device):
        """Per level: True everywhere except the image's ceil(h / stride) x ceil(w / stride) corner."""
        masks = []
        assert len(feature_shapes) == len(self.feature_strides)
        for idx, shape in enumerate(feature_shapes):
            N, _, H, W = shape
            masks_per_feature_level = torch.ones((N, H, W), dtype=torch.bool, device=device)
            for img_idx, (h, w) in enumerate(image_sizes):
                masks_per_feature_level[
                    img_idx,
                    : int(np.ceil(float(h) / self.feature_strides[idx])),
                    : int(np.ceil(float(w) / self.feature_strides[idx])),
                ] = 0
            masks.append(masks_per_feature_level)
        return masks


def detector_postprocess(results, output_height, output_width, mask_threshold=0.5):
    """Scales control points from the network's input size to (output_height, output_width), in place.

    Unlike detectron2's, it keeps ``results.image_size`` (the input size), as upstream does.
    """
    scale_x, scale_y = (output_width / results.image_size[1], output_height / results.image_size[0])
    if results.has("beziers"):
        beziers = results.beziers
        # clip the end points (x0, y0, x3, y3 of both curves) to the image
        h, w = results.image_size
        for x_col in (0, 6, 8, 14):
            beziers[:, x_col].clamp_(min=0, max=w)
            beziers[:, x_col + 1].clamp_(min=0, max=h)
        beziers[:, 0::2] *= scale_x
        beziers[:, 1::2] *= scale_y
    if results.has("polygons"):
        polygons = results.polygons
        polygons[:, 0::2] *= scale_x
        polygons[:, 1::2] *= scale_y
    return results


@META_ARCH_REGISTRY.register()
class TransformerDetector(nn.Module):
    """TESTR on a detectron2 backbone: list[dict] in, list[{"instances": Instances}] out."""

    def __init__(self, cfg):
        super().__init__()
        self.device = torch.device(cfg.MODEL.DEVICE)

        d2_backbone = MaskedBackbone(cfg)
        N_steps = cfg.MODEL.TRANSFORMER.HIDDEN_DIM // 2
        self.test_score_threshold = cfg.MODEL.TRANSFORMER.INFERENCE_TH_TEST
        self.use_polygon = cfg.MODEL.TRANSFORMER.USE_POLYGON
        backbone = Joiner(d2_backbone, PositionalEncoding2D(N_steps, normalize=True))
        backbone.num_channels = d2_backbone.num_channels
        self.testr = TESTR(cfg, backbone)
        self.criterion = SetCriterion(cfg.MODEL.TRANSFORMER.LOSS, cfg.MODEL.TRANSFORMER.VOC_SIZE,
                                      ctc=cfg.MODEL.TRANSFORMER.TEXT_CTC)
        # training only (LOSS.CHAR_CENTRE_WEIGHT): reads characters from the finest map; inference never calls it
        self.char_centre_class = nn.Linear(cfg.MODEL.TRANSFORMER.HIDDEN_DIM, cfg.MODEL.TRANSFORMER.VOC_SIZE) \
            if cfg.MODEL.TRANSFORMER.LOSS.CHAR_CENTRE_WEIGHT > 0 else None

        # plain tensors in a closure, not buffers: not in the state dict, and not moved by .to()
        pixel_mean = torch.Tensor(cfg.MODEL.PIXEL_MEAN).to(self.device).view(3, 1, 1)
        pixel_std = torch.Tensor(cfg.MODEL.PIXEL_STD).to(self.device).view(3, 1, 1)
        self.normalizer = lambda x: (x - pixel_mean) / pixel_std
        self.to(self.device)

    def preprocess_image(self, batched_inputs):
        """Normalise, pad and batch the input images."""
        images = [self.normalizer(x["image"].to(self.device)) for x in batched_inputs]
        return ImageList.from_tensors(images)

    def forward(self, batched_inputs):
        """
        batched_inputs: list of dicts with "image" (C, H, W) in cfg.INPUT.FORMAT and optional "height",
        "width" (the output resolution). Returns one {"instances": Instances} per image with scores,
        pred_classes, rec_scores (n, n_chars, voc+1), recs (n, n_chars) and polygons or beziers (n, 2 * n_ctrl).
        """
        images = self.preprocess_image(batched_inputs)
        output = self.testr(images)
        if self.training:
            gt = [x["instances"].to(self.device) for x in batched_inputs]
            targets = self.prepare_targets(gt)
            losses = self.criterion(output, targets)
            if self.char_centre_class is not None:
                losses["loss_char_centres"] = char_centre_loss(
                    self.char_centre_class, output["char_features"], targets, images.image_sizes,
                    images.tensor.shape[-2:], self.criterion.voc_size)
            return {k: v * self.criterion.weight(k) for k, v in losses.items()}

        ctrl_point_cls = output["pred_logits"]
        ctrl_point_coord = output["pred_ctrl_points"]
        text_pred = output["pred_texts"]
        results = self.inference(ctrl_point_cls, ctrl_point_coord, text_pred, images.image_sizes)
        processed_results = []
        for results_per_image, input_per_image, image_size in zip(results, batched_inputs, images.image_sizes):
            height = input_per_image.get("height", image_size[0])
            width = input_per_image.get("width", image_size[1])
            r = detector_postprocess(results_per_image, height, width)
            processed_results.append({"instances": r})
        return processed_results

    def prepare_targets(self, targets):
        """Per image: labels, control points (polygons or Beziers, as the model predicts them) and (cx, cy, w, h)
        boxes relative to the unpadded image, and the character ids."""
        prepared = []
        field = "polygons" if self.use_polygon else "beziers"
        for t in targets:
            h, w = t.image_size
            scale = torch.as_tensor([w, h], dtype=torch.float32, device=self.device)
            if not t.has(field):  # a picture without words: the mapper had no annotation to make the fields from
                t.set(field, torch.zeros(0, self.testr.num_ctrl_points * 2, device=self.device))
                t.text = torch.zeros(0, self.testr.max_text_len, dtype=torch.int32, device=self.device)
            points = t.get(field).view(len(t), self.testr.num_ctrl_points, 2) / scale
            boxes = box_convert(t.gt_boxes.tensor / scale.repeat(2), "xyxy", "cxcywh")
            # the sets store 25 character slots; a model with fewer text queries (NUM_CHARS) learns the first ones
            texts = t.text[:, :self.testr.max_text_len]
            prepared.append({"labels": t.gt_classes, "ctrl_points": points, "boxes": boxes, "texts": texts})
        return prepared

    def inference(self, ctrl_point_cls, ctrl_point_coord, text_pred, image_sizes):
        """Keeps the queries whose mean control-point score passes the threshold; points to pixels."""
        assert len(ctrl_point_cls) == len(image_sizes)
        results = []

        text_pred = torch.softmax(text_pred, dim=-1)
        prob = ctrl_point_cls.mean(-2).sigmoid()
        scores, labels = prob.max(-1)

        for scores_per_image, labels_per_image, ctrl_point_per_image, text_per_image, image_size in zip(
            scores, labels, ctrl_point_coord, text_pred, image_sizes
        ):
            selector = scores_per_image >= self.test_score_threshold
            scores_per_image = scores_per_image[selector]
            labels_per_image = labels_per_image[selector]
            ctrl_point_per_image = ctrl_point_per_image[selector]
            text_per_image = text_per_image[selector]
            result = Instances(image_size)
            result.scores = scores_per_image
            result.pred_classes = labels_per_image
            result.rec_scores = text_per_image
            ctrl_point_per_image[..., 0] *= image_size[1]
            ctrl_point_per_image[..., 1] *= image_size[0]
            if self.use_polygon:
                result.polygons = ctrl_point_per_image.flatten(1)
            else:
                result.beziers = ctrl_point_per_image.flatten(1)
            _, topi = text_per_image.topk(1)
            result.recs = topi.squeeze(-1)
            results.append(result)
        return results
