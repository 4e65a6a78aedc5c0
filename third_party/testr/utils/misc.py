"""Small helpers of the TESTR code base (inference-relevant ones only)."""
from typing import List, Optional

import torch
from torch import Tensor


def inverse_sigmoid(x, eps=1e-5):
    x = x.clamp(min=0, max=1)
    x1 = x.clamp(min=eps)
    x2 = (1 - x).clamp(min=eps)
    return torch.log(x1 / x2)


def sigmoid_offset(x, offset=True):
    # with offset the range is widened to [-0.5, 1.5] (bezier control points may leave the image)
    if offset:
        return x.sigmoid() * 2 - 0.5
    return x.sigmoid()


def inverse_sigmoid_offset(x, eps=1e-5, offset=True):
    if offset:
        x = (x + 0.5) / 2.0
    return inverse_sigmoid(x, eps)


def box_xyxy_to_cxcywh(x):
    x0, y0, x1, y1 = x.unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def _max_by_axis(the_list):
    # type: (List[List[int]]) -> List[int]
    maxes = list(the_list[0])
    for sublist in the_list[1:]:
        for index, item in enumerate(sublist):
            maxes[index] = max(maxes[index], item)
    return maxes


def nested_tensor_from_tensor_list(tensor_list: List[Tensor]):
    """Pads (C, H, W) images to a common size; the mask is True on padding."""
    if tensor_list[0].ndim != 3:
        raise ValueError("not supported")
    b = len(tensor_list)
    c, h, w = _max_by_axis([list(img.shape) for img in tensor_list])
    first = tensor_list[0]
    tensor = torch.zeros((b, c, h, w), dtype=first.dtype, device=first.device)
    mask = torch.ones((b, h, w), dtype=torch.bool, device=first.device)
    for img, pad_img, m in zip(tensor_list, tensor, mask):
        pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return NestedTensor(tensor, mask)


class NestedTensor(object):
    """A batch of feature maps and its padding mask (True on padding)."""

    def __init__(self, tensors, mask: Optional[Tensor]):
        self.tensors = tensors
        self.mask = mask

    def to(self, device):
        mask = self.mask.to(device) if self.mask is not None else None
        return NestedTensor(self.tensors.to(device), mask)

    def decompose(self):
        return self.tensors, self.mask

    def __repr__(self):
        return str(self.tensors)
