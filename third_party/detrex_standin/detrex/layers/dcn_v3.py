"""DCNv3, InternImage's deformable convolution, in detrex's layout (detrex/layers/dcn_v3.py), written for the stand-in.

As upstream: a channels-last module (a depth-wise convolution predicting offsets and per-group softmax masks, input
and output projections) whose core is an autograd Function calling the compiled `_C.dcnv3_forward`; `_C` is detrex's
extension, the one the MSDA op comes from. Unbuilt, the module fails where it computes, as upstream's did in the
issue (module 'detrex._C' has no attribute 'dcnv3_forward').
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from detrex import _C


class DCNv3Function(Function):
    @staticmethod
    def forward(ctx, input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                dilation_w, group, group_channels, offset_scale, im2col_step):
        ctx.args = (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                    group_channels, offset_scale)
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(input, offset, mask)
        return _C.dcnv3_forward(input, offset, mask, *ctx.args, im2col_step)

    @staticmethod
    def backward(ctx, grad_output):
        grads = _C.dcnv3_backward(*ctx.saved_tensors, *ctx.args, grad_output.contiguous(), ctx.im2col_step)
        return (*grads, *([None] * 12))


class DCNv3(nn.Module):
    """x [N, H, W, C] -> [N, H, W, C] (stride 1, padding keeping the size, as InternImage's blocks use it)."""

    def __init__(self, channels=64, kernel_size=3, stride=1, pad=1, dilation=1, group=4, offset_scale=1.0):
        super().__init__()
        if channels % group:
            raise ValueError(f"channels must be divisible by group, but got {channels} and {group}")
        self.channels, self.kernel_size, self.stride, self.pad = channels, kernel_size, stride, pad
        self.dilation, self.group, self.group_channels = dilation, group, channels // group
        self.offset_scale = offset_scale
        self.dw_conv = nn.Conv2d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2, groups=channels)
        self.dw_norm = nn.LayerNorm(channels)
        self.offset = nn.Linear(channels, group * kernel_size * kernel_size * 2)
        self.mask = nn.Linear(channels, group * kernel_size * kernel_size)
        self.input_proj = nn.Linear(channels, channels)
        self.output_proj = nn.Linear(channels, channels)

    def forward(self, input):
        n, h, w, _ = input.shape
        x = self.input_proj(input)
        x1 = F.gelu(self.dw_norm(self.dw_conv(input.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)))
        offset = self.offset(x1)
        mask = F.softmax(self.mask(x1).reshape(n, h, w, self.group, -1), -1).reshape(n, h, w, -1)
        x = DCNv3Function.apply(x, offset, mask, self.kernel_size, self.kernel_size, self.stride, self.stride,
                                self.pad, self.pad, self.dilation, self.dilation, self.group, self.group_channels,
                                self.offset_scale, 256)
        return self.output_proj(x)
