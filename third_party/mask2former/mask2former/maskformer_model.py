"""MaskFormer meta-architecture (Mask2Former's `mask2former/maskformer_model.py`), inference only.

Stand-in written for d2export's tests. Constructor arguments, `from_config` keys, the eval `forward` and the three
post-processing methods (`semantic_inference`, `panoptic_inference`, `instance_inference`) behave as upstream's.
Training is left out: `from_config` builds upstream's loss weights and a `SetCriterion` shell that holds only the
`empty_weight` buffer checkpoints carry (no matcher, no losses), and `forward` in training mode raises.
"""
from typing import Tuple

import torch
from torch import nn
from torch.nn import functional as F

from detectron2.config import configurable
from detectron2.data import MetadataCatalog
from detectron2.modeling import META_ARCH_REGISTRY, build_backbone, build_sem_seg_head
from detectron2.modeling.backbone import Backbone
from detectron2.modeling.postprocessing import sem_seg_postprocess
from detectron2.structures import Boxes, ImageList, Instances
from detectron2.utils.memory import retry_if_cuda_oom

from .modeling.criterion import SetCriterion


@META_ARCH_REGISTRY.register()
class MaskFormer(nn.Module):
    """Mask classification: N queries, each a class distribution (K + 1, last = no object) and a mask."""

    @configurable
    def __init__(
        self,
        *,
        backbone: Backbone,
        sem_seg_head: nn.Module,
        criterion: nn.Module,
        num_queries: int,
        object_mask_threshold: float,
        overlap_threshold: float,
        metadata,
        size_divisibility: int,
        sem_seg_postprocess_before_inference: bool,
        pixel_mean: Tuple[float],
        pixel_std: Tuple[float],
        semantic_on: bool,
        panoptic_on: bool,
        instance_on: bool,
        test_topk_per_image: int,
    ):
        super().__init__()
        self.backbone = backbone
        self.sem_seg_head = sem_seg_head
        self.criterion = criterion  # a shell here: this stand-in does not train
        self.num_queries = num_queries
        self.overlap_threshold = overlap_threshold
        self.object_mask_threshold = object_mask_threshold
        self.metadata = metadata
        # a negative value defers to what the backbone asks for (ResNet says 0, hence MASK_FORMER.SIZE_DIVISIBILITY)
        self.size_divisibility = self.backbone.size_divisibility if size_divisibility < 0 else size_divisibility
        self.sem_seg_postprocess_before_inference = sem_seg_postprocess_before_inference
        self.register_buffer("pixel_mean", torch.Tensor(pixel_mean).view(-1, 1, 1), False)
        self.register_buffer("pixel_std", torch.Tensor(pixel_std).view(-1, 1, 1), False)
        self.semantic_on = semantic_on
        self.instance_on = instance_on
        self.panoptic_on = panoptic_on
        self.test_topk_per_image = test_topk_per_image
        if not self.semantic_on:
            assert self.sem_seg_postprocess_before_inference

    @classmethod
    def from_config(cls, cfg):
        backbone = build_backbone(cfg)
        sem_seg_head = build_sem_seg_head(cfg, backbone.output_shape())
        mf = cfg.MODEL.MASK_FORMER

        # upstream's loss weights; its HungarianMatcher is left out (inference only)
        base_weights = {"loss_ce": mf.CLASS_WEIGHT, "loss_mask": mf.MASK_WEIGHT, "loss_dice": mf.DICE_WEIGHT}
        weight_dict = dict(base_weights)
        if mf.DEEP_SUPERVISION:  # one set per auxiliary prediction
            for i in range(mf.DEC_LAYERS - 1):
                weight_dict.update({f"{k}_{i}": v for k, v in base_weights.items()})
        criterion = SetCriterion(
            sem_seg_head.num_classes,
            matcher=None,
            weight_dict=weight_dict,
            eos_coef=mf.NO_OBJECT_WEIGHT,
            losses=["labels", "masks"],
            num_points=mf.TRAIN_NUM_POINTS,
            oversample_ratio=mf.OVERSAMPLE_RATIO,
            importance_sample_ratio=mf.IMPORTANCE_SAMPLE_RATIO,
        )
        return {
            "backbone": backbone,
            "sem_seg_head": sem_seg_head,
            "criterion": criterion,
            "num_queries": mf.NUM_OBJECT_QUERIES,
            "object_mask_threshold": mf.TEST.OBJECT_MASK_THRESHOLD,
            "overlap_threshold": mf.TEST.OVERLAP_THRESHOLD,
            "metadata": MetadataCatalog.get(cfg.DATASETS.TRAIN[0]),
            "size_divisibility": mf.SIZE_DIVISIBILITY,
            # panoptic and instance outputs need masks at the output size, so they force the early resize
            "sem_seg_postprocess_before_inference": (
                mf.TEST.SEM_SEG_POSTPROCESSING_BEFORE_INFERENCE or mf.TEST.PANOPTIC_ON or mf.TEST.INSTANCE_ON
            ),
            "pixel_mean": cfg.MODEL.PIXEL_MEAN,
            "pixel_std": cfg.MODEL.PIXEL_STD,
            "semantic_on": mf.TEST.SEMANTIC_ON,
            "instance_on": mf.TEST.INSTANCE_ON,
            "panoptic_on": mf.TEST.PANOPTIC_ON,
            "test_topk_per_image": cfg.TEST.DETECTIONS_PER_IMAGE,
        }

    @property
    def device(self):
        return self.pixel_mean.device

    def forward(self, batched_inputs):
        """list[dict] with "image" (C, H, W) and optional "height"/"width" -> list[dict] with any of "sem_seg"
        (K, height, width scores), "panoptic_seg" ((height, width) int32 ids, segments_info) and "instances"."""
        images = [x["image"].to(self.device) for x in batched_inputs]
        images = [(x - self.pixel_mean) / self.pixel_std for x in images]
        images = ImageList.from_tensors(images, self.size_divisibility)

        features = self.backbone(images.tensor)
        outputs = self.sem_seg_head(features)

        if self.training:
            raise NotImplementedError("the Mask2Former stand-in is inference only (no criterion)")

        mask_cls_results = outputs["pred_logits"]
        # masks come at 1/4 of the padded input: bring them to the padded size
        mask_pred_results = F.interpolate(
            outputs["pred_masks"],
            size=(images.tensor.shape[-2], images.tensor.shape[-1]),
            mode="bilinear",
            align_corners=False,
        )
        del outputs

        processed_results = []
        for mask_cls_result, mask_pred_result, input_per_image, image_size in zip(
            mask_cls_results, mask_pred_results, batched_inputs, images.image_sizes
        ):
            height = input_per_image.get("height", image_size[0])
            width = input_per_image.get("width", image_size[1])
            result = {}
            processed_results.append(result)

            if self.sem_seg_postprocess_before_inference:
                # crop the padding off, then resize to the requested output size
                mask_pred_result = retry_if_cuda_oom(sem_seg_postprocess)(mask_pred_result, image_size, height, width)
                mask_cls_result = mask_cls_result.to(mask_pred_result)

            if self.semantic_on:
                r = retry_if_cuda_oom(self.semantic_inference)(mask_cls_result, mask_pred_result)
                if not self.sem_seg_postprocess_before_inference:
                    r = retry_if_cuda_oom(sem_seg_postprocess)(r, image_size, height, width)
                result["sem_seg"] = r

            if self.panoptic_on:
                result["panoptic_seg"] = retry_if_cuda_oom(self.panoptic_inference)(mask_cls_result, mask_pred_result)

            if self.instance_on:
                result["instances"] = retry_if_cuda_oom(self.instance_inference)(mask_cls_result, mask_pred_result)

        return processed_results

    def semantic_inference(self, mask_cls, mask_pred):
        """(Q, K+1) logits, (Q, H, W) mask logits -> (K, H, W): class probabilities (no-object dropped) weighted by
        mask probabilities, summed over queries."""
        probs = F.softmax(mask_cls, dim=-1)[..., :-1]
        return torch.einsum("qc,qhw->chw", probs, mask_pred.sigmoid())

    def panoptic_inference(self, mask_cls, mask_pred):
        """-> ((H, W) int32 segment ids, 0 = void; list of {"id", "isthing", "category_id"})."""
        scores, labels = F.softmax(mask_cls, dim=-1).max(-1)
        mask_pred = mask_pred.sigmoid()

        # queries whose best class is a real one, scored above the threshold
        keep = labels.ne(self.sem_seg_head.num_classes) & (scores > self.object_mask_threshold)
        cur_scores = scores[keep]
        cur_classes = labels[keep]
        cur_masks = mask_pred[keep]

        cur_prob_masks = cur_scores.view(-1, 1, 1) * cur_masks

        h, w = cur_masks.shape[-2:]
        panoptic_seg = torch.zeros((h, w), dtype=torch.int32, device=cur_masks.device)
        segments_info = []
        if cur_masks.shape[0] == 0:
            return panoptic_seg, segments_info

        # each pixel goes to the query with the highest score * mask probability
        cur_mask_ids = cur_prob_masks.argmax(0)
        thing_ids = self.metadata.thing_dataset_id_to_contiguous_id.values()
        stuff_segment_of_class = {}
        current_segment_id = 0
        for k in range(cur_classes.shape[0]):
            pred_class = cur_classes[k].item()
            isthing = pred_class in thing_ids
            won = cur_mask_ids == k
            own = cur_masks[k] >= 0.5
            mask_area = won.sum().item()
            original_area = own.sum().item()
            mask = won & own
            if not (mask_area > 0 and original_area > 0 and mask.sum().item() > 0):
                continue
            # drop a query that kept too little of its own mask
            if mask_area / original_area < self.overlap_threshold:
                continue
            if not isthing:
                # one segment per stuff class: later queries of that class join the first one's segment
                if int(pred_class) in stuff_segment_of_class:
                    panoptic_seg[mask] = stuff_segment_of_class[int(pred_class)]
                    continue
                stuff_segment_of_class[int(pred_class)] = current_segment_id + 1
            current_segment_id += 1
            panoptic_seg[mask] = current_segment_id
            segments_info.append({"id": current_segment_id, "isthing": bool(isthing), "category_id": int(pred_class)})
        return panoptic_seg, segments_info

    def instance_inference(self, mask_cls, mask_pred):
        """Top-k over all (query, class) pairs -> Instances at the mask size: binary pred_masks, zero boxes,
        scores = class probability * mean mask probability inside the binary mask, pred_classes."""
        image_size = mask_pred.shape[-2:]
        num_classes = self.sem_seg_head.num_classes

        scores = F.softmax(mask_cls, dim=-1)[:, :-1]  # (Q, K)
        labels = torch.arange(num_classes, device=self.device).unsqueeze(0).repeat(self.num_queries, 1).flatten(0, 1)
        scores_per_image, topk_indices = scores.flatten(0, 1).topk(self.test_topk_per_image, sorted=False)
        labels_per_image = labels[topk_indices]
        query_indices = topk_indices // num_classes
        mask_pred = mask_pred[query_indices]

        if self.panoptic_on:
            # a panoptic model's instance output keeps thing classes only
            thing_ids = self.metadata.thing_dataset_id_to_contiguous_id.values()
            keep = torch.zeros_like(scores_per_image).bool()
            for i, lab in enumerate(labels_per_image):
                keep[i] = lab in thing_ids
            scores_per_image = scores_per_image[keep]
            labels_per_image = labels_per_image[keep]
            mask_pred = mask_pred[keep]

        result = Instances(image_size)
        result.pred_masks = (mask_pred > 0).float()
        # upstream leaves boxes at zero (boxes from masks are slow)
        result.pred_boxes = Boxes(torch.zeros(mask_pred.size(0), 4))
        binary = result.pred_masks.flatten(1)
        mask_scores_per_image = (mask_pred.sigmoid().flatten(1) * binary).sum(1) / (binary.sum(1) + 1e-6)
        result.scores = scores_per_image * mask_scores_per_image
        result.pred_classes = labels_per_image
        return result
