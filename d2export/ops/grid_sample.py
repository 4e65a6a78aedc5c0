"""`bilinear_grid_sample`: a drop-in for 4-D bilinear `F.grid_sample` without a GridSample node.

For models that call F.grid_sample and must export below opset 16 or to runtimes without (a trustworthy) GridSample:
the sample is one Gather of 2×2 pixel windows and one MatMul with the bilinear weights (see `_bilinear`),
all opset 11.
"""
from __future__ import annotations

import torch

from ._bilinear import bilinear_window, quad_table


def bilinear_grid_sample(input: torch.Tensor, grid: torch.Tensor, align_corners: bool = False,
                         padding_mode: str = "zeros") -> torch.Tensor:
    """Same result as `F.grid_sample(input, grid, "bilinear", padding_mode, align_corners)` for 4-D input.

    input [N, C, H, W], grid [N, Ho, Wo, 2] normalised (x, y) in [-1, 1]  ->  [N, C, Ho, Wo] in input's dtype.
    padding_mode: "zeros" or "border". Coordinates are computed in float32 (or float64) whatever input's dtype.
    """
    if input.dim() != 4 or grid.dim() != 4:
        raise ValueError(f"expected input [N, C, H, W] and grid [N, Ho, Wo, 2], got {tuple(input.shape)} and "
                         f"{tuple(grid.shape)}")
    n, c, h, w = input.shape
    _, ho, wo, _ = grid.shape
    compute = torch.promote_types(input.dtype, torch.float32)
    # While tracing, shape entries are 0-d tensors recorded from the input's shape: keep them so the exported graph
    # follows the input's size; eagerly they are ints.
    height, width = (v.to(compute) if isinstance(v, torch.Tensor) else
                     torch.tensor(v, dtype=compute, device=input.device) for v in (h, w))
    grid = grid.to(compute)
    if align_corners:  # -1 and 1 are the centres of the corner pixels
        x = (grid[..., 0] + 1) * 0.5 * (width - 1)
        y = (grid[..., 1] + 1) * 0.5 * (height - 1)
    else:  # -1 and 1 are the outer edges of the corner pixels
        x = ((grid[..., 0] + 1) * width - 1) * 0.5
        y = ((grid[..., 1] + 1) * height - 1) * 0.5
    offset, weight = bilinear_window(x.reshape(n, ho * wo), y.reshape(n, ho * wo), width, height, padding_mode)
    # Rows of the quad table [N * H * W, 4C]: image b's windows start at row b * H * W.
    batch = torch.arange(n, dtype=offset.dtype, device=input.device).view(n, 1) * (h * w)
    table = quad_table(input.to(compute).permute(0, 2, 3, 1).reshape(n, h * w, c), w).reshape(n * h * w, 4 * c)
    sampled = table.index_select(0, (offset + batch).reshape(-1)).view(n, ho * wo, 4, c)
    out = torch.matmul(weight.unsqueeze(-2), sampled)  # [N, Ho*Wo, 1, C]
    return out.view(n, ho, wo, c).permute(0, 3, 1, 2).to(input.dtype)
