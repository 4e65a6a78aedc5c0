"""Independent float64 references for tests: MSDA and bilinear grid sampling written out corner by corner.

Deliberately naive and shares no code with d2export.ops: sizes are Python ints, each level and each of the four
corners is handled separately, out-of-image corners are masked explicitly. Differentiable (autograd), so it also
serves as the gradient reference.
"""
from __future__ import annotations

import torch


def _bilinear_level(image: torch.Tensor, px: torch.Tensor, py: torch.Tensor, padding_mode: str) -> torch.Tensor:
    """image [B, H, W, C]; px, py [B, K] pixel coordinates (centres at integers)  ->  [B, K, C]."""
    b, h, w, c = image.shape
    if padding_mode == "border":
        px, py = px.clamp(0, w - 1), py.clamp(0, h - 1)
    x0, y0 = torch.floor(px), torch.floor(py)
    out = image.new_zeros(b, px.shape[1], c)
    batch = torch.arange(b).view(b, 1).expand_as(px)
    for dx in (0, 1):
        for dy in (0, 1):
            xi, yi = x0 + dx, y0 + dy
            wgt = (1 - (px - xi).abs()) * (1 - (py - yi).abs())
            inside = (xi >= 0) & (xi <= w - 1) & (yi >= 0) & (yi <= h - 1)
            xc = xi.clamp(0, w - 1).long()
            yc = yi.clamp(0, h - 1).long()
            corner = image[batch, yc, xc]  # [B, K, C]
            out = out + corner * (wgt * inside).unsqueeze(-1)
    return out


def msda_reference(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Float64 MSDA, CUDA-op semantics (bilinear, zeros padding, align_corners=False)  ->  [N, Lq, M*D]."""
    value = value.double()
    loc = sampling_locations.double()
    attn = attention_weights.double()
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = loc.shape
    out = value.new_zeros(n, lq, m, d)
    for level, ((h, w), start) in enumerate(zip(spatial_shapes.tolist(), level_start_index.tolist())):
        image = value[:, start:start + h * w].reshape(n, h, w, m, d).permute(0, 3, 1, 2, 4).reshape(n * m, h, w, d)
        loc_l = loc[:, :, :, level].permute(0, 2, 1, 3, 4).reshape(n * m, lq * n_points, 2)
        px = loc_l[..., 0] * w - 0.5
        py = loc_l[..., 1] * h - 0.5
        sampled = _bilinear_level(image, px, py, "zeros").view(n, m, lq, n_points, d).permute(0, 2, 1, 3, 4)
        out = out + (sampled * attn[:, :, :, level].unsqueeze(-1)).sum(3)
    return out.reshape(n, lq, m * d)


def grid_sample_reference(image, grid, align_corners=False, padding_mode="zeros"):
    """Float64 4-D bilinear grid sampling: image [N, C, H, W], grid [N, Ho, Wo, 2] (x, y in [-1, 1])."""
    image, grid = image.double(), grid.double()
    n, c, h, w = image.shape
    _, ho, wo, _ = grid.shape
    gx, gy = grid[..., 0].reshape(n, -1), grid[..., 1].reshape(n, -1)
    if align_corners:
        px, py = (gx + 1) / 2 * (w - 1), (gy + 1) / 2 * (h - 1)
    else:
        px, py = ((gx + 1) * w - 1) / 2, ((gy + 1) * h - 1) / 2
    out = _bilinear_level(image.permute(0, 2, 3, 1), px, py, padding_mode)  # [N, Ho*Wo, C]
    return out.permute(0, 2, 1).reshape(n, c, ho, wo)


def random_msda_inputs(shapes, n=2, lq=7, heads=2, dim=4, points=3, lo=-0.1, hi=1.1, seed=0, dtype=torch.float32):
    """Random MSDA inputs for level sizes `shapes` [(H, W), ...]; locations uniform in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed)
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64)
    areas = spatial_shapes.prod(1)
    level_start_index = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    s = int(areas.sum())
    levels = len(shapes)
    value = torch.randn(n, s, heads, dim, generator=gen, dtype=dtype)
    loc = lo + (hi - lo) * torch.rand(n, lq, heads, levels, points, 2, generator=gen, dtype=dtype)
    attn = torch.rand(n, lq, heads, levels * points, generator=gen, dtype=dtype).softmax(-1)
    return value, spatial_shapes, level_start_index, loc, attn.view(n, lq, heads, levels, points)


def edge_locations(h: int, w: int) -> torch.Tensor:
    """[1, Q, 1, 1, 1, 2] locations on an h×w level's pixel centres and edges, exactly on and beyond its border, and
    far outside."""
    xs = torch.tensor([k / (2 * w) for k in range(-3, 2 * w + 4)] + [-5.0, 7.0, 1e6])
    ys = torch.tensor([k / (2 * h) for k in range(-3, 2 * h + 4)] + [-1e6, 3.0, 0.5])
    return torch.stack(torch.meshgrid(xs, ys, indexing="ij"), -1).reshape(1, -1, 1, 1, 1, 2)
