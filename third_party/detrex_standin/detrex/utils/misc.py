import torch


def inverse_sigmoid(x, eps=1e-3):
    """log(x / (1 - x)) with both sides clamped away from 0 (the eps is part of what the model computes)."""
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))
