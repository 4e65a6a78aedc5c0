"""Registered export-time patches for detectron2's own model zoo (families rcnn, retinanet, panoptic_fpn): the graph takes
one image per run, and these keep what detectron2 does per image size-general."""
from __future__ import annotations

import torch

from d2export.ops import keypoints, rewrites
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
                    "traced count into the graph: the next picture's count fails in onnxruntime's Split")
def split_whole(tensor, split_size_or_sections, dim=0):
    sections = split_size_or_sections
    if isinstance(sections, (list, tuple)) and len(sections) == 1 and sections[0] == tensor.shape[dim]:
        return (tensor,)  # one section holding everything: the tensor itself, whatever its traced size
    return NotImplemented


@register_patch("bitmask-boxes", function="detectron2.structures.masks.BitMasks.get_bounding_boxes",
                why="a Python loop over the masks (MaskDINO's `INITIALIZE_BOX_TYPE: bitmask`) bakes their count: a "
                    "batch of another size is wrong in onnxruntime")
def bitmask_boxes(self):
    from detectron2.structures import Boxes

    return Boxes(rewrites.mask_boxes(self.tensor))


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
    import torchvision

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
    offsets = classes.to(boxes) * (boxes.max() + 1)  # torchvision's batched NMS: classes apart by coordinates
    keep = torchvision.ops.nms(boxes + offsets[:, None], scores, self.test_nms_thresh)
    keep = keep[: self.max_detections_per_image]
    return _instances(image_size, boxes[keep], scores=scores[keep], pred_classes=classes[keep])


def _instances(image_size, boxes, **fields):
    """Instances with `pred_boxes` and `fields`, made as detectron2's constructors make them but without their
    Python tests of the count (Boxes' `numel() == 0`, Instances.set's `len()`), which torch.export cannot have."""
    from detectron2.structures import Boxes, Instances

    result = Instances(image_size)
    pred_boxes = Boxes.__new__(Boxes)
    pred_boxes.tensor = boxes.to(torch.float32)
    result._fields.update(pred_boxes=pred_boxes, **fields)
    return result
