"""`SetCriterion` shell: the stand-in does not train, but upstream's criterion owns a buffer (`empty_weight`, the
per-class weight of the classification loss, no-object last) that every Mask2Former checkpoint carries as
`criterion.empty_weight`. Keeping the module keeps state dicts identical, so checkpoints load with strict=True."""
import torch
from torch import nn


class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, eos_coef, losses, num_points, oversample_ratio,
                 importance_sample_ratio):
        super().__init__()
        self.num_classes = num_classes
        self.matcher = matcher  # upstream: HungarianMatcher; None here
        self.weight_dict = weight_dict
        self.eos_coef = eos_coef
        self.losses = losses
        weights = torch.ones(num_classes + 1)
        weights[-1] = eos_coef
        self.register_buffer("empty_weight", weights)
        self.num_points = num_points
        self.oversample_ratio = oversample_ratio
        self.importance_sample_ratio = importance_sample_ratio

    def forward(self, outputs, targets):
        raise NotImplementedError("the Mask2Former stand-in is inference only: no matcher, no losses")
