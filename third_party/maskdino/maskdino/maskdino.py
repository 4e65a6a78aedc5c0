"""The inference half of MaskDINO's meta-architecture (IDEA-Research/MaskDINO `maskdino/maskdino.py`, class
`MaskDINO`), written for this project with upstream's semantics: the eval branch of `forward` and the three
inference functions, on what the head returns. Its differences from Mask2Former's MaskFormer:
- the head returns (outputs, denoising record) and a box per query (`pred_boxes`, cx cy w h relative to the padded
  batch);
- classes are scored by a sigmoid, K of them, no "no object" class; with `transform_eval` panoptic and semantic
  scores are sharpened by a softmax of the sigmoids at temperature `pano_temp`; `semantic_ce_loss` (set only for
  semantic-only configs trained with cross-entropy) scores semantic classes by a softmax without its last column,
  as upstream writes it;
- instance boxes are the predicted ones, scaled to the original picture over the padded size; `focus_on_box` scores
  instances by their class alone.
Training, the criterion and the model's construction are not here.
"""
import torch
from torch.nn import functional as F

from detectron2.modeling.postprocessing import sem_seg_postprocess
from detectron2.structures import Boxes, ImageList, Instances


def box_cxcywh_to_xyxy(boxes):
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


class MaskDINO:
    def forward(self, batched_inputs):
        images = [(x["image"].to(self.device) - self.pixel_mean) / self.pixel_std for x in batched_inputs]
        images = ImageList.from_tensors(images, self.size_divisibility)
        features = self.backbone(images.tensor)
        outputs, _ = self.sem_seg_head(features)
        padded = images.tensor.shape[-2:]
        masks = F.interpolate(outputs["pred_masks"], size=padded, mode="bilinear", align_corners=False)
        results = []
        for cls, mask, box, given, size in zip(outputs["pred_logits"], masks, outputs["pred_boxes"], batched_inputs,
                                               images.image_sizes):
            height, width = given.get("height", size[0]), given.get("width", size[1])
            result = {}
            if self.sem_seg_postprocess_before_inference:
                mask = sem_seg_postprocess(mask, size, height, width)
                cls = cls.to(mask)
            if self.semantic_on:
                sem = self.semantic_inference(cls, mask)
                result["sem_seg"] = sem if self.sem_seg_postprocess_before_inference else sem_seg_postprocess(
                    sem, size, height, width)
            if self.panoptic_on:
                result["panoptic_seg"] = self.panoptic_inference(cls, mask)
            if self.instance_on:
                # boxes are relative to the padded batch: scaled to the original picture's pixels over it
                scaled = self.box_postprocess(box.to(mask), padded[0] / size[0] * height, padded[1] / size[1] * width)
                result["instances"] = self.instance_inference(cls, mask, scaled)
            results.append(result)
        return results

    def class_scores(self, mask_cls):
        """Per query and class, sharpened when transform_eval is set."""
        scores = mask_cls.sigmoid()
        return F.softmax(scores / self.pano_temp, dim=-1) if self.transform_eval else scores

    def semantic_inference(self, mask_cls, mask_pred):
        if self.semantic_ce_loss:
            classes = F.softmax(mask_cls, dim=-1)[..., :-1]
        else:
            classes = self.class_scores(mask_cls)
        return torch.einsum("qc,qhw->chw", classes, mask_pred.sigmoid())

    def panoptic_inference(self, mask_cls, mask_pred):
        best, labels = mask_cls.sigmoid().max(-1)
        keep = labels.ne(self.sem_seg_head.num_classes) & (best > self.object_mask_threshold)
        scores, labels = self.class_scores(mask_cls).max(-1)
        probs = mask_pred.sigmoid()
        kept_scores, kept_classes, kept_masks = scores[keep], labels[keep], probs[keep]
        panoptic = torch.zeros(probs.shape[-2:], dtype=torch.int32)
        segments = []
        if len(kept_masks) == 0:
            return panoptic, segments
        winner = (kept_scores.view(-1, 1, 1) * kept_masks).argmax(0)
        things = set(self.metadata.thing_dataset_id_to_contiguous_id.values())
        stuff, current = {}, 0
        for k in range(len(kept_classes)):
            label = int(kept_classes[k])
            won = winner == k
            covered = kept_masks[k] >= 0.5
            area, own, kept = int(won.sum()), int(covered.sum()), int((won & covered).sum())
            if not (area > 0 and own > 0 and kept > 0) or area / own < self.overlap_threshold:
                continue
            isthing = label in things
            if not isthing and label in stuff:
                panoptic[won & covered] = stuff[label]
                continue
            if not isthing:
                stuff[label] = current + 1
            current += 1
            panoptic[won & covered] = current
            segments.append({"id": current, "isthing": bool(isthing), "category_id": label})
        return panoptic, segments

    def instance_inference(self, mask_cls, mask_pred, mask_box_result):
        num_classes = self.sem_seg_head.num_classes
        scores = mask_cls.sigmoid()
        top_scores, top = scores.flatten().topk(self.test_topk_per_image, sorted=False)
        labels, queries = top % num_classes, top // num_classes
        if self.panoptic_on:
            things = set(self.metadata.thing_dataset_id_to_contiguous_id.values())
            thing = torch.tensor([int(label) in things for label in labels], dtype=torch.bool)
            top_scores, labels, queries = top_scores[thing], labels[thing], queries[thing]
        result = Instances(mask_pred.shape[-2:])
        masks = mask_pred[queries]
        result.pred_masks = (masks > 0).float()
        result.pred_boxes = Boxes(mask_box_result[queries])
        flat = result.pred_masks.flatten(1)
        mean = (masks.sigmoid().flatten(1) * flat).sum(1) / (flat.sum(1) + 1e-6)
        result.scores = top_scores * (1.0 if self.focus_on_box else mean)
        result.pred_classes = labels
        return result

    def box_postprocess(self, out_bbox, img_h, img_w):
        scale = torch.tensor([img_w, img_h, img_w, img_h]).to(out_bbox)
        return box_cxcywh_to_xyxy(out_bbox) * scale
