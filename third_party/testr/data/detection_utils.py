"""AdelaiDet's additions to detectron2's annotation handling for text: Bezier control points (`beziers`), boundary
points (`polygons`) and transcriptions (`rec`) follow the picture's transforms and become Instances fields."""
import numpy as np
import torch
from detectron2.data import detection_utils as d2_utils
from detectron2.data import transforms as T


def transform_points(flat, transforms):
    """A flat [x0, y0, x1, y1, …] list through the transforms; text must not be mirrored."""
    if any(isinstance(t, T.HFlipTransform) for t in transforms.transforms):
        raise ValueError("flipping text labels is not supported")
    return transforms.apply_coords(np.asarray(flat, dtype=np.float64).reshape(-1, 2)).reshape(-1)


def transform_instance_annotations(annotation, transforms, image_size):
    annotation = d2_utils.transform_instance_annotations(annotation, transforms, image_size)
    for key in ("beziers", "polygons"):
        if key in annotation:
            annotation[key] = transform_points(annotation[key], transforms)
    return annotation


def annotations_to_instances(annos, image_size, mask_format="polygon"):
    instances = d2_utils.annotations_to_instances(annos, image_size, mask_format)
    if annos:
        for key, field, dtype in (("beziers", "beziers", torch.float32), ("rec", "text", torch.int32),
                                  ("polygons", "polygons", torch.float32)):
            if key in annos[0]:
                setattr(instances, field, torch.as_tensor(np.array([a[key] for a in annos]), dtype=dtype))
    return instances


def build_augmentation(cfg, is_train):
    """Resize the shorter side as detectron2 does; no flips (text would read backwards)."""
    if is_train:
        sizes, max_size, style = cfg.INPUT.MIN_SIZE_TRAIN, cfg.INPUT.MAX_SIZE_TRAIN, cfg.INPUT.MIN_SIZE_TRAIN_SAMPLING
    else:
        sizes, max_size, style = cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST, "choice"
    return [T.ResizeShortestEdge(sizes, max_size, style)]
