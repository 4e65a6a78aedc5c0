"""Bezier helpers DeepSolo's model uses at inference (its training-side curve fitting is left out)."""
import torch


def upcast(t):
    """float16/bfloat16 → float32 and small integers → int32 before a product that could overflow."""
    if t.is_floating_point():
        return t if t.dtype in (torch.float32, torch.float64) else t.float()
    return t if t.dtype in (torch.int32, torch.int64) else t.int()
