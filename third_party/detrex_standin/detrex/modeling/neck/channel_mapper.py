import copy

import torch.nn as nn


class ConvNormAct(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True, norm=None,
                 activation=None):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=bias)
        self.norm = norm
        self.activation = activation

    def forward(self, x):
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.activation is not None:
            x = self.activation(x)
        return x


class ChannelMapper(nn.Module):
    """Backbone features (a dict) → `num_outs` maps of `out_channels`; extra levels by stride-2 3×3 convolutions
    on the last input feature, then on each extra level."""

    def __init__(self, input_shapes, in_features, out_channels, kernel_size=3, stride=1, bias=True,
                 norm_layer=None, activation=None, num_outs=None, **kwargs):
        super().__init__()
        num_outs = num_outs or len(in_features)
        self.in_features = in_features
        channels = [input_shapes[f].channels for f in in_features]

        def block(cin, k, s, p):
            return ConvNormAct(cin, out_channels, k, s, p, bias, copy.deepcopy(norm_layer), copy.deepcopy(activation))

        self.convs = nn.ModuleList(block(c, kernel_size, stride, (kernel_size - 1) // 2) for c in channels)
        self.extra_convs = nn.ModuleList(block(channels[-1] if i == 0 else out_channels, 3, 2, 1)
                                         for i in range(num_outs - len(in_features)))

    def forward(self, inputs):
        outs = [conv(inputs[f]) for conv, f in zip(self.convs, self.in_features)]
        for i, conv in enumerate(self.extra_convs):
            outs.append(conv(inputs[self.in_features[-1]] if i == 0 else outs[-1]))
        return tuple(outs)
