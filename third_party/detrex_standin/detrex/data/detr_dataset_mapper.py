import numpy as np
import torch

import detectron2.data.transforms as T
from detectron2.data import detection_utils as utils


class DetrDatasetMapper:
    """Test-time mapping only: read the picture in `img_format`, apply `augmentation`, CHW tensor."""

    def __init__(self, augmentation, augmentation_with_crop=None, is_train=False, mask_on=False, img_format="RGB"):
        self.augmentation = T.AugmentationList(augmentation)
        self.is_train = is_train
        self.img_format = img_format

    def __call__(self, dataset_dict):
        dataset_dict = dict(dataset_dict)
        image = utils.read_image(dataset_dict["file_name"], format=self.img_format)
        image = T.AugInput(image)
        self.augmentation(image)
        dataset_dict["image"] = torch.as_tensor(np.ascontiguousarray(image.image.transpose(2, 0, 1)))
        return dataset_dict
