"""Registered export-time patches for detectron2's own model zoo (families rcnn, retinanet, panoptic_fpn): the graph takes
one image per run, and these keep what detectron2 does per image size-general."""
from __future__ import annotations

import torch

from d2export.ops import keypoints, tensor_ops
from d2export.patching.registry import register_patch


@register_patch("keypoints-from-heatmaps",
                function="detectron2.modeling.roi_heads.keypoint_head.heatmaps_to_keypoints",
                why="detectron2's scripted ROI loop indexes a tensor of unknown rank: aten::index fails to export")
def heatmaps_to_keypoints(maps, rois):
    if torch.compiler.is_exporting():  # torch.export runs the loop in Python: it would bake the traced ROI count
        raise RuntimeError("Keypoint R-CNN's heatmaps resize per ROI to sizes read from the boxes' values, which "
                           "torch.export cannot capture (it would unroll the traced ROI count into the graph): "
                           "export it with export.exporter=torchscript")
    return keypoints.heatmaps_to_keypoints(maps, rois)


@register_patch("split-whole", function=("torch.Tensor.split", "torch.split"),
                why="x.split([len(x)]) (detectron2's per-image split of one image's boxes, scores, masks) bakes the "
                    "traced count into the graph: the next picture's count fails in onnxruntime's Split; and a "
                    "chunk size that does not divide the dim is exported as equal pieces")
def split_whole(tensor, split_size_or_sections, dim=0):
    sections = split_size_or_sections
    if isinstance(sections, (list, tuple)) and len(sections) == 1 and sections[0] == tensor.shape[dim]:
        return (tensor,)  # one section holding everything: the tensor itself, whatever its traced size
    chunk = isinstance(sections, int) or (isinstance(sections, torch.Tensor) and sections.dim() == 0)
    if chunk and torch.jit.is_tracing() and int(tensor.shape[dim]) % int(sections):
        # a chunk size that does not divide the dim (DeepSolo++'s `hs.split(hs.shape[3] - 1, dim=3)`: 25 and 1; a
        # traced size is a tensor): the exporter writes equal pieces (25 and 25 of 26); narrowed pieces keep the
        # lengths traced (their count is the trace's, as a Split's outputs are)
        total, last = tensor.shape[dim], int(tensor.shape[dim]) // int(sections)
        return tuple([tensor.narrow(dim, i * sections, sections) for i in range(last)]
                     + [tensor.narrow(dim, last * sections, total - last * sections)])
    return NotImplemented


@register_patch("bitmask-boxes", function="detectron2.structures.masks.BitMasks.get_bounding_boxes",
                why="a Python loop over the masks (MaskDINO's `INITIALIZE_BOX_TYPE: bitmask`) bakes their count: a "
                    "batch of another size is wrong in onnxruntime")
def bitmask_boxes(self):
    from detectron2.structures import Boxes

    return Boxes(tensor_ops.mask_boxes(self.tensor))


# --- torch.export: detectron2's per-image code, where torch.export reads data-dependent sizes ------------------------
# Eagerly and under TorchScript's trace these defer to detectron2's own code; under torch.export a count that depends
# on the data (detections kept by a threshold, by NMS) is a symbol whose value is unknown, and every Python test of
# it (`len()`, `numel() == 0`, `min(count, k)`) fails the capture. Each patch computes the same without the test.
def _exporting() -> bool:
    return torch.compiler.is_exporting()


@register_patch("image-list-for-torch-export", function="detectron2.structures.image_list.ImageList.from_tensors",
                why="ImageList pads one image by its sizes turned into tensors (shapes_to_tensor): under torch.export "
                    "their values are data and the padding's shape cannot be guarded; the same padding from the "
                    "image's symbolic sizes")
def image_list_from_tensors(tensors, size_divisibility=0, pad_value=0.0, padding_constraints=None):
    constraints = dict(padding_constraints or {})
    if not _exporting() or len(tensors) != 1 or constraints.get("square_size", 0) > 0:
        return NotImplemented  # square padding (ViTDet) keeps detectron2's own
    size_divisibility = constraints.get("size_divisibility", size_divisibility)
    from detectron2.structures import ImageList

    image = tensors[0]
    h, w = image.shape[-2:]
    d = max(int(size_divisibility), 1)
    padded = torch.nn.functional.pad(image, [0, (d - w % d) % d, 0, (d - h % d) % d], value=pad_value)
    return ImageList(padded[None], [(h, w)])


def _is_dense_detector(module) -> bool:
    """detectron2's RetinaNet (and its DenseDetector kin with RetinaNet's single-image inference)."""
    return all(hasattr(module, a) for a in ("inference_single_image", "box2box_transform", "test_topk_candidates",
                                            "test_nms_thresh", "max_detections_per_image"))


@register_patch("dense-inference-for-torch-export", module=lambda name, module: _is_dense_detector(module),
                method="inference_single_image",
                why="RetinaNet's single-image inference keeps a level's scores past the threshold, then the top "
                    "min(count, k) (`min` of a data-dependent count), and builds Boxes and Instances whose "
                    "`numel() == 0` and `len()` checks need Python ints of it; the top k of all scores, then those "
                    "past the threshold (the same candidates in the same order), one NMS over class-offset boxes")
def dense_inference(self, anchors, box_cls, box_delta, image_size):
    if not _exporting():
        return NotImplemented
    boxes, scores, classes = [], [], []
    for anchors_i, scores_i, deltas_i in zip(anchors, box_cls, box_delta):
        values, flat = scores_i.flatten().topk(torch.sym_min(int(self.test_topk_candidates), scores_i.numel()))
        kept = values > self.test_score_thresh
        values, flat = values[kept], flat[kept]
        anchor_idxs, class_idxs = flat // scores_i.shape[1], flat % scores_i.shape[1]
        boxes.append(self.box2box_transform.apply_deltas(deltas_i[anchor_idxs], anchors_i.tensor[anchor_idxs]))
        scores.append(values)
        classes.append(class_idxs)
    boxes, scores, classes = torch.cat(boxes), torch.cat(scores), torch.cat(classes)
    keep = _batched_nms(boxes, scores, classes, self.test_nms_thresh)[: self.max_detections_per_image]
    return _instances(image_size, pred_boxes=boxes[keep], scores=scores[keep], pred_classes=classes[keep])


def _batched_nms(boxes, scores, groups, threshold: float):
    """torchvision's batched NMS as its coordinate trick computes it (groups set apart by an offset), without its
    choice of implementation by `boxes.numel()`: a test of a data-dependent count."""
    import torchvision

    offsets = groups.to(boxes) * (boxes.max() + 1)
    return torchvision.ops.nms(boxes + offsets[:, None], scores, threshold)


def _clipped(boxes, size):
    """Boxes.clip without its finiteness assert (a data-dependent test): each coordinate clamped to the image."""
    h, w = size
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack((x1.clamp(min=0, max=w), y1.clamp(min=0, max=h), x2.clamp(min=0, max=w),
                        y2.clamp(min=0, max=h)), dim=-1)


def _instances(image_size, **fields):
    """Instances with these fields (tensors; `*_boxes` as Boxes), made as detectron2's constructors make them but
    without their Python tests of the count (Boxes' `numel() == 0`, Instances.set's `len()`), which torch.export
    cannot have."""
    from detectron2.structures import Boxes, Instances

    result = Instances(image_size)
    for name, value in fields.items():
        if name.endswith("_boxes"):
            boxes = Boxes.__new__(Boxes)
            boxes.tensor = value.to(torch.float32)
            value = boxes
        result._fields[name] = value
    return result


@register_patch("rpn-proposals-for-torch-export", module="detectron2.modeling.proposal_generator.rpn.RPN",
                method="predict_proposals",
                why="the RPN's top proposals filter invalid and empty boxes only `if not valid.all()` and `if "
                    "keep.sum().item() != len(boxes)`, clip with a finiteness assert and build Boxes and Instances "
                    "that test their count: data-dependent tests; filtering always keeps the same proposals")
def rpn_proposals(self, anchors, pred_objectness_logits, pred_anchor_deltas, image_sizes):
    if not _exporting() or self.training or len(image_sizes) != 1:
        return NotImplemented
    with torch.no_grad():
        proposals = self._decode_proposals(anchors, pred_anchor_deltas)
        boxes, scores, levels = [], [], []
        for level, (proposals_i, logits_i) in enumerate(zip(proposals, pred_objectness_logits)):
            top, index = logits_i[0].topk(torch.sym_min(self.pre_nms_topk[False], logits_i.shape[1]))
            boxes.append(proposals_i[0, index])
            scores.append(top)
            levels.append(torch.full_like(index, level))
        boxes, scores, levels = torch.cat(boxes), torch.cat(scores), torch.cat(levels)
        valid = torch.isfinite(boxes).all(dim=1) & torch.isfinite(scores)
        boxes, scores, levels = _clipped(boxes[valid], image_sizes[0]), scores[valid], levels[valid]
        widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        keep = (widths > self.min_box_size) & (heights > self.min_box_size)  # Boxes.nonempty
        boxes, scores, levels = boxes[keep], scores[keep], levels[keep]
        keep = _batched_nms(boxes, scores, levels, self.nms_thresh)[: self.post_nms_topk[False]]
        return [_instances(image_sizes[0], proposal_boxes=boxes[keep], objectness_logits=scores[keep])]


@register_patch("roi-pooler-for-torch-export", module="detectron2.modeling.poolers.ROIPooler",
                why="the pooler turns one image's proposal count into a tensor (`__len__` through shapes_to_tensor) "
                    "and repeats the image index by it: a second, unrelated data-dependent size; for one image, "
                    "index 0 beside every box, then detectron2's own per-level pooling")
def roi_pooler(self, x, box_lists):
    from detectron2.modeling.poolers import assign_boxes_to_levels
    from detectron2.structures import Boxes

    if not _exporting() or len(box_lists) != 1 or type(box_lists[0]) is not Boxes:
        return NotImplemented
    boxes = box_lists[0].tensor
    rois = torch.cat([torch.zeros_like(boxes[:, :1]), boxes], dim=1)  # convert_boxes_to_pooler_format, one image
    if len(self.level_poolers) == 1:
        return self.level_poolers[0](x[0], rois)
    levels = assign_boxes_to_levels(box_lists, self.min_level, self.max_level, self.canonical_box_size,
                                    self.canonical_level)
    output = x[0].new_zeros((boxes.shape[0], x[0].shape[1], *self.output_size))
    for level, pooler in enumerate(self.level_poolers):
        index = torch.nonzero(levels == level).squeeze(1)
        output = output.index_put((index,), pooler(x[level], rois[index]))
    return output


@register_patch("box-predictions-for-torch-export",
                module="detectron2.modeling.roi_heads.fast_rcnn.FastRCNNOutputLayers", method="predict_boxes",
                why="the box predictor splits its boxes by `len()` of each image's proposals: Python ints of a "
                    "data-dependent count; for one image they are the whole tensor")
def predict_boxes(self, predictions, proposals):
    if not _exporting() or len(proposals) != 1:
        return NotImplemented
    return (self.box2box_transform.apply_deltas(predictions[1], proposals[0].proposal_boxes.tensor),)


@register_patch("box-probabilities-for-torch-export",
                module="detectron2.modeling.roi_heads.fast_rcnn.FastRCNNOutputLayers", method="predict_probs",
                why="the box predictor splits its class probabilities by `len()` of each image's proposals: Python "
                    "ints of a data-dependent count; for one image they are the whole tensor")
def predict_probs(self, predictions, proposals):
    if not _exporting() or len(proposals) != 1:
        return NotImplemented
    return (predictions[0].sigmoid() if self.use_sigmoid_ce else torch.softmax(predictions[0], dim=-1),)


@register_patch("box-inference-for-torch-export",
                function="detectron2.modeling.roi_heads.fast_rcnn.fast_rcnn_inference_single_image",
                why="per image it filters non-finite boxes `if not valid.all()`, clips with Boxes.clip's finiteness "
                    "assert, lets torchvision choose its NMS by the count and builds Boxes and Instances that test "
                    "it: data-dependent tests; filtering always keeps the same detections")
def box_inference(boxes, scores, image_shape, score_thresh, nms_thresh, topk_per_image):
    if not _exporting():
        return NotImplemented
    valid = torch.isfinite(boxes).all(dim=1) & torch.isfinite(scores).all(dim=1)
    boxes, scores = boxes[valid], scores[valid][:, :-1]
    classes_per_box = boxes.shape[1] // 4
    boxes = _clipped(boxes.reshape(-1, 4), image_shape).view(-1, classes_per_box, 4)
    passing = scores > score_thresh
    index = passing.nonzero()
    boxes = boxes[index[:, 0], 0] if classes_per_box == 1 else boxes[passing]
    scores = scores[passing]
    keep = _batched_nms(boxes, scores, index[:, 1], nms_thresh)
    if topk_per_image >= 0:
        keep = keep[:topk_per_image]
    return _instances(image_shape, pred_boxes=boxes[keep], scores=scores[keep], pred_classes=index[keep, 1]), \
        index[keep, 0]


@register_patch("cascade-proposals-for-torch-export",
                module="detectron2.modeling.roi_heads.cascade_rcnn.CascadeROIHeads",
                method="_create_proposals_from_boxes",
                why="Cascade R-CNN's next-stage proposals are Boxes (an empty test), clipped (a finiteness assert) "
                    "and set on Instances (a `len()` check): data-dependent tests; the same proposals without them")
def cascade_proposals(self, boxes, image_sizes):
    if not _exporting() or self.training:
        return NotImplemented
    return [_instances(size, proposal_boxes=_clipped(b.detach(), size)) for b, size in zip(boxes, image_sizes)]


@register_patch("mask-probabilities-for-torch-export",
                function="detectron2.modeling.roi_heads.mask_head.mask_rcnn_inference",
                why="Mask R-CNN's mask inference splits the masks by `len()` of each image's detections and sets "
                    "them through Instances.set's `len()` check: Python ints of a data-dependent count; for one "
                    "image the same probabilities (the predicted class's mask), set as a field")
def mask_probabilities(pred_mask_logits, pred_instances):
    if not _exporting() or len(pred_instances) != 1:
        return NotImplemented
    if pred_mask_logits.shape[1] == 1:  # class-agnostic
        probs = pred_mask_logits.sigmoid()
    else:
        classes = pred_instances[0].pred_classes
        probs = pred_mask_logits[torch.arange(pred_mask_logits.shape[0]), classes][:, None].sigmoid()
    pred_instances[0]._fields["pred_masks"] = probs
    return None
