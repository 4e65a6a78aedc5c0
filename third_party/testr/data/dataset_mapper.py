"""AdelaiDet's `DatasetMapperWithBasis`, reduced to what TESTR trains with: read the picture, resize it, carry the
text fields along."""
import copy

import numpy as np
import torch
from detectron2.data import detection_utils as d2_utils
from detectron2.data import transforms as T

from testr.data.detection_utils import annotations_to_instances, build_augmentation, transform_instance_annotations


class DatasetMapperWithBasis:
    def __init__(self, cfg, is_train=True):
        self.augmentation = T.AugmentationList(build_augmentation(cfg, is_train))
        self.image_format = cfg.INPUT.FORMAT
        self.is_train = is_train

    def __call__(self, dataset_dict):
        record = copy.deepcopy(dataset_dict)
        image = record.pop("image", None)  # a picture drawn in memory (RGB) has no file to read
        if image is None:
            image = d2_utils.read_image(record["file_name"], format=self.image_format)
        elif self.image_format == "BGR":
            image = image[..., ::-1]
        d2_utils.check_image_size(record, image)
        aug = T.AugInput(image)
        transforms = self.augmentation(aug)
        image = aug.image
        record["image"] = torch.as_tensor(np.ascontiguousarray(image.transpose(2, 0, 1)))
        annos = record.pop("annotations", None)
        if not self.is_train or annos is None:
            return record
        annos = [transform_instance_annotations(a, transforms, image.shape[:2]) for a in annos
                 if a.get("iscrowd", 0) == 0]
        record["instances"] = d2_utils.filter_empty_instances(annotations_to_instances(annos, image.shape[:2]))
        return record
