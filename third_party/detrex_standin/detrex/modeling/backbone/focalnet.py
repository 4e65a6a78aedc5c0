"""FocalNet as detrex builds it for DINO (detrex/modeling/backbone/focalnet.py), written for the stand-in, with its
export-hostile habits: Swin's patch embedding (the image padded to the patch size under Python `if`s, also the
stage-to-stage downsampling), stages called with Python H and W set on their blocks, and focal modulation (gated
depth-wise convolutions at growing kernels plus a global context) in place of window attention."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from detectron2.modeling.backbone import Backbone


class FocalModulation(nn.Module):
    def __init__(self, dim, focal_window=3, focal_level=2, focal_factor=2):
        super().__init__()
        self.focal_level = focal_level
        self.f = nn.Linear(dim, 2 * dim + focal_level + 1)
        self.h = nn.Conv2d(dim, dim, 1)
        self.proj = nn.Linear(dim, dim)
        self.focal_layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(dim, dim, focal_factor * k + focal_window, groups=dim,
                                    padding=(focal_factor * k + focal_window) // 2, bias=False), nn.GELU())
            for k in range(focal_level))

    def forward(self, x):
        c = x.shape[-1]
        q, ctx, gates = torch.split(self.f(x).permute(0, 3, 1, 2), (c, c, self.focal_level + 1), 1)
        ctx_all = 0
        for level in range(self.focal_level):
            ctx = self.focal_layers[level](ctx)
            ctx_all = ctx_all + ctx * gates[:, level:level + 1]
        ctx_all = ctx_all + F.gelu(ctx.mean(2, keepdim=True).mean(3, keepdim=True)) * gates[:, self.focal_level:]
        return self.proj((q * self.h(ctx_all)).permute(0, 2, 3, 1))


class FocalModulationBlock(nn.Module):
    def __init__(self, dim, mlp_ratio=4.0, focal_window=3, focal_level=2):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.modulation = FocalModulation(dim, focal_window, focal_level)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))
        self.H = self.W = None

    def forward(self, x):
        b, length, c = x.shape
        h, w = self.H, self.W
        assert length == h * w, "input feature has wrong size"
        x = x + self.modulation(self.norm1(x).view(b, h, w, c)).view(b, h * w, c)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch_size=4, in_chans=3, embed_dim=96, norm_layer=None):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.embed_dim = embed_dim
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = norm_layer(embed_dim) if norm_layer else None

    def forward(self, x):
        _, _, h, w = x.size()
        if w % self.patch_size[1] != 0:
            x = F.pad(x, (0, self.patch_size[1] - w % self.patch_size[1]))
        if h % self.patch_size[0] != 0:
            x = F.pad(x, (0, 0, 0, self.patch_size[0] - h % self.patch_size[0]))
        x = self.proj(x)
        if self.norm is not None:
            wh, ww = x.size(2), x.size(3)
            x = self.norm(x.flatten(2).transpose(1, 2)).transpose(1, 2).view(-1, self.embed_dim, wh, ww)
        return x


class BasicLayer(nn.Module):
    def __init__(self, dim, depth, focal_window, focal_level, downsample=True):
        super().__init__()
        self.blocks = nn.ModuleList(FocalModulationBlock(dim, focal_window=focal_window, focal_level=focal_level)
                                    for _ in range(depth))
        self.downsample = PatchEmbed(2, dim, 2 * dim, nn.LayerNorm) if downsample else None

    def forward(self, x, H, W):
        for block in self.blocks:
            block.H, block.W = H, W
            x = block(x)
        if self.downsample is None:
            return x, H, W, x, H, W
        down = self.downsample(x.transpose(1, 2).view(x.shape[0], x.shape[-1], H, W)).flatten(2).transpose(1, 2)
        return x, H, W, down, (H + 1) // 2, (W + 1) // 2


class FocalNet(Backbone):
    def __init__(self, patch_size=4, embed_dim=96, depths=(2, 2, 6, 2), focal_levels=(2, 2, 2, 2),
                 focal_windows=(9, 9, 9, 9), out_indices=(0, 1, 2, 3)):
        super().__init__()
        self.out_indices = tuple(out_indices)
        self.patch_embed = PatchEmbed(patch_size, 3, embed_dim, nn.LayerNorm)
        self.layers = nn.ModuleList(BasicLayer(embed_dim * 2 ** i, depths[i], focal_windows[i], focal_levels[i],
                                               downsample=i < len(depths) - 1) for i in range(len(depths)))
        self.num_features = [embed_dim * 2 ** i for i in range(len(depths))]
        for i in self.out_indices:
            self.add_module(f"norm{i}", nn.LayerNorm(self.num_features[i]))
        self._out_features = [f"p{i}" for i in self.out_indices]
        self._out_feature_channels = {f"p{i}": self.num_features[i] for i in self.out_indices}
        self._out_feature_strides = {f"p{i}": 2 ** (i + 2) for i in self.out_indices}

    def forward(self, x):
        x = self.patch_embed(x)
        wh, ww = x.size(2), x.size(3)
        x = x.flatten(2).transpose(1, 2)
        outs = {}
        for i, layer in enumerate(self.layers):
            x_out, h, w, x, wh, ww = layer(x, wh, ww)
            if i in self.out_indices:
                x_out = getattr(self, f"norm{i}")(x_out)
                outs[f"p{i}"] = x_out.view(-1, h, w, self.num_features[i]).permute(0, 3, 1, 2).contiguous()
        return outs
