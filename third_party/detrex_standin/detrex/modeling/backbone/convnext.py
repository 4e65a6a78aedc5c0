"""ConvNeXt as detrex builds it for DINO (detrex/modeling/backbone/convnext.py), written for the stand-in: a 4x4
stride-4 stem and 2x2 stride-2 downsampling convolutions, each with a channels-first LayerNorm, blocks of a 7x7
depth-wise convolution, a channels-last LayerNorm, an MLP and layer scale; outputs p0..p3 normalised. No Python size
logic: it should export at any size as it is (the test says whether it does)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from detectron2.modeling.backbone import Backbone


class LayerNorm(nn.Module):
    """detrex.layers.LayerNorm: over the last axis (channels last), or over channels of [N, C, H, W] by hand."""

    def __init__(self, dim, eps=1e-6, channel_last=True):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.eps, self.channel_last, self.dim = eps, channel_last, (dim,)

    def forward(self, x):
        if self.channel_last:
            return F.layer_norm(x, self.dim, self.weight, self.bias, self.eps)
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Block(nn.Module):
    def __init__(self, dim, layer_scale_init_value=1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = LayerNorm(dim)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale_init_value * torch.ones(dim))

    def forward(self, x):
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(Backbone):
    def __init__(self, in_chans=3, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), layer_scale_init_value=1e-6,
                 out_indices=(0, 1, 2, 3)):
        super().__init__()
        self.out_indices = tuple(out_indices)
        self.downsample_layers = nn.ModuleList([nn.Sequential(nn.Conv2d(in_chans, dims[0], 4, stride=4),
                                                              LayerNorm(dims[0], channel_last=False))])
        for i in range(3):
            self.downsample_layers.append(nn.Sequential(LayerNorm(dims[i], channel_last=False),
                                                        nn.Conv2d(dims[i], dims[i + 1], 2, stride=2)))
        self.stages = nn.ModuleList([nn.Sequential(*[Block(dims[i], layer_scale_init_value) for _ in range(depths[i])])
                                     for i in range(4)])
        for i in self.out_indices:
            self.add_module(f"norm{i}", LayerNorm(dims[i], channel_last=False))
        self._out_features = [f"p{i}" for i in self.out_indices]
        self._out_feature_channels = {f"p{i}": dims[i] for i in self.out_indices}
        self._out_feature_strides = {f"p{i}": 2 ** (i + 2) for i in self.out_indices}

    def forward(self, x):
        outs = {}
        for i in range(4):
            x = self.stages[i](self.downsample_layers[i](x))
            if i in self.out_indices:
                outs[f"p{i}"] = getattr(self, f"norm{i}")(x)
        return outs
