"""Size-general patches for the backbones deployed checkpoints stand on.

- Swin in its three copies (Mask2Former / OneFormer / MaskDINO's `D2SwinTransformer`, detectron2's `SwinTransformer`
  as detrex configs use it, AdelaiDet / DeepSolo's `adet/modeling/swin`), which share one code. Traced as written,
  each stage bakes its shift mask's window count, each block its padding decision, crop and batch (window_reverse's
  `int(...)`), patch merging and patch embedding their odd-size padding: a graph right only at the dummy's window
  counts and batch. Modules are found by what they have; each replacement computes what the original does, from
  traced sizes (d2export/ops/windows.py), with the original's own submodules.
- ViTDet (detectron2's `ViT`, as detrex's `dino-vitdet` configs build it): its helpers (detectron2/modeling/backbone/
  utils.py, imported by name into vit.py and mvit.py) decide the windows' padding and crop, the relative-position
  table's resizing and the absolute position embedding's resizing with Python `if`s on the sizes. The replacements
  take over only for traced sizes; eagerly (ints) the originals run.
- InternImage's DCNv3: its autograd Function, found by its arguments, replaced by the compiled op's stand-in.
- ViTAEv2 (DeepSolo's `adet/modeling/vitae_v2`): its window_reverse, which bakes the batch as Swin's does.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from d2export.ops import windows
from d2export.ops.level_shapes import is_size
from d2export.patching import compiled_ops
from d2export.patching.registry import forward_args, module_where, register_patch


def is_swin_block(module) -> bool:
    """A shifted-window block: window and shift sizes, a window attention with a relative position table, two norms
    and an MLP, called as forward(x, mask_matrix) with its H and W set by its stage."""
    attn = getattr(module, "attn", None)
    sizes = (getattr(module, "window_size", None), getattr(module, "shift_size", None))
    return (all(isinstance(s, int) for s in sizes) and hasattr(attn, "relative_position_bias_table")
            and all(hasattr(module, a) for a in ("norm1", "norm2", "mlp", "drop_path"))
            and forward_args(module) == ["x", "mask_matrix"])


def is_swin_stage(module) -> bool:
    """A stage of shifted-window blocks that builds their mask: forward(x, H, W)."""
    blocks = getattr(module, "blocks", None)
    return (isinstance(blocks, nn.ModuleList) and len(blocks) > 0 and is_swin_block(blocks[0])
            and isinstance(getattr(module, "shift_size", None), int) and hasattr(module, "downsample")
            and forward_args(module) == ["x", "H", "W"])


def is_patch_merging(module) -> bool:
    """Swin's 2x2 patch merging: a norm and a bias-free Linear from 4C to 2C channels, forward(x, H, W)."""
    reduction = getattr(module, "reduction", None)
    return (isinstance(reduction, nn.Linear) and reduction.in_features == 2 * reduction.out_features
            and hasattr(module, "norm") and not hasattr(module, "blocks")
            and forward_args(module) == ["x", "H", "W"])


def is_patch_embed(module) -> bool:
    """A patch embedding that pads the image to its patch size, then convolves with the patch size as stride (Swin's;
    FocalNet's too, whose overlapping variant has a larger kernel), forward(x) returning the map."""
    proj = getattr(module, "proj", None)
    return (isinstance(proj, nn.Conv2d) and tuple(proj.stride) == _pair(getattr(module, "patch_size", None))
            and hasattr(module, "embed_dim") and hasattr(module, "norm") and forward_args(module) == ["x"])


def _pair(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


def swin_stage_forward(self, x, H, W):
    """The stage's shift mask from its padded sizes; the blocks and the merging as the original calls them."""
    window = self.window_size
    mask = windows.shift_mask(windows.ceil_to(H, window), windows.ceil_to(W, window), window, self.shift_size,
                              x.device)
    for block in self.blocks:
        block.H, block.W = H, W
        x = block(x, mask)  # (checkpointing, where configured, recomputes the same values in training only)
    if self.downsample is None:
        return x, H, W, x, H, W
    return x, H, W, self.downsample(x, H, W), (H + 1) // 2, (W + 1) // 2


def swin_block_forward(self, x, mask_matrix):
    """Pad to whole windows, (shift,) attend per window, reverse, (unshift,) crop: the batch from the tensors, the
    padding and the crop unconditional (no-ops where the map is whole windows)."""
    batch, _, channels = x.shape
    height, width, window, shift = self.H, self.W, self.window_size, self.shift_size
    shortcut = x
    x = windows.pad_bottom_right(self.norm1(x).view(batch, height, width, channels), window)
    padded_h, padded_w = x.shape[1], x.shape[2]
    if shift > 0:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    attended = self.attn(windows.partition(x, window).view(-1, window * window, channels),
                         mask=mask_matrix if shift > 0 else None)
    x = windows.reverse(attended.view(-1, window, window, channels), window, padded_h, padded_w)
    if shift > 0:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    x = x[:, :height, :width].reshape(batch, height * width, channels)
    x = shortcut + self.drop_path(x)
    return x + self.drop_path(self.mlp(self.norm2(x)))


def patch_merging_forward(self, x, H, W):
    batch, _, channels = x.shape
    x = windows.pad_bottom_right(x.view(batch, H, W, channels), 2)
    x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
    return self.reduction(self.norm(x.view(batch, -1, 4 * channels)))


def patch_embed_forward(self, x):
    x = self.proj(windows.pad_bottom_right(x, _pair(self.patch_size), channels_last=False))
    if self.norm is not None:
        height, width = x.shape[2], x.shape[3]
        x = self.norm(x.flatten(2).transpose(1, 2)).transpose(1, 2).view(-1, self.embed_dim, height, width)
    return x


register_patch("swin-shift-mask", module=module_where(is_swin_stage),
               why="the shifted-window mask is built with np.ceil and Python slices of the feature size: a constant "
                   "of the dummy's window count")(swin_stage_forward)
register_patch("swin-window-sizes", module=module_where(is_swin_block),
               why="window_reverse reads the batch back as an int, and the padding and crop are decided by Python "
                   "ifs: the dummy's batch and padding baked")(swin_block_forward)
register_patch("swin-patch-merging", module=module_where(is_patch_merging),
               why="odd sizes padded under a Python if: the dummy's parity baked")(patch_merging_forward)
register_patch("patch-embed-padding", module=module_where(is_patch_embed),
               why="the image padded to the patch size under Python ifs: the dummy's remainder baked"
               )(patch_embed_forward)


# --- ViTDet: detectron2's backbone helpers, wherever vit.py and mvit.py bound them -----------------------------------
def _helper(name: str) -> tuple[str, ...]:
    return tuple(f"detectron2.modeling.backbone.{m}.{name}" for m in ("utils", "vit", "mvit"))


def _traced(*sizes) -> bool:
    return any(is_size(s) for s in sizes)


@register_patch("vit-window-padding", function=_helper("window_partition"),
                why="pads to whole windows under a Python if: the dummy's remainder baked")
def vit_window_partition(x, window_size):
    if not _traced(*x.shape[1:3]):
        return NotImplemented
    x = windows.pad_bottom_right(x, window_size)
    return windows.partition(x, window_size), (x.shape[1], x.shape[2])


@register_patch("vit-window-crop", function=_helper("window_unpartition"),
                why="crops the padding under a Python if: the dummy's padding baked")
def vit_window_unpartition(parts, window_size, pad_hw, hw):
    if not _traced(*pad_hw, *hw):
        return NotImplemented
    (padded_h, padded_w), (height, width) = pad_hw, hw
    return windows.reverse(parts, window_size, padded_h, padded_w)[:, :height, :width].contiguous()


@register_patch("vit-relative-positions", function="detectron2.modeling.backbone.utils.get_rel_pos",
                why="the relative-position table is resized under a Python if and indexed by Python-int coordinates: "
                    "global attention baked to the dummy's token grid")
def vit_rel_pos(q_size, k_size, rel_pos):
    if not _traced(q_size, k_size) or q_size is not k_size:  # ViTDet's self-attention passes one size twice
        return NotImplemented
    return windows.relative_position_table(rel_pos, q_size)


@register_patch("vit-position-embedding", function=_helper("get_abs_pos"),
                why="the absolute position embedding is resized only where the dummy's grid differs from the "
                    "pretraining one (a Python if): another grid is added the dummy's embedding")
def vit_abs_pos(abs_pos, has_cls_token, hw):
    if not _traced(*hw):
        return NotImplemented
    return windows.resized_position_embedding(abs_pos, has_cls_token, *hw)


# --- InternImage: DCNv3's compiled op, called through an autograd Function --------------------------------------------
_DCNV3_ARGS = ["input", "offset", "mask", "kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w",
               "dilation_h", "dilation_w", "group", "group_channels", "offset_scale", "im2col_step"]


def is_dcnv3_function(cls) -> bool:
    """An autograd Function with the compiled DCNv3 op's arguments (InternImage's, detrex's `DCNv3Function`)."""
    try:
        return list(inspect.signature(cls.forward).parameters)[1:] == _DCNV3_ARGS
    except (TypeError, ValueError):
        return False


register_patch("dcnv3-core", autograd=is_dcnv3_function,
               why="DCNv3's compiled op (detrex._C / InternImage's DCNv3 extension) has no CPU kernel and cannot be "
                   "traced through its autograd Function: d2export's pure-PyTorch DCNv3 instead (the compiled op's "
                   "stand-in, which takes the Function's arguments)")(compiled_ops.dcnv3_forward)


# --- ViTAEv2 (DeepSolo's adet/modeling/vitae_v2): its window_reverse reads the batch back as an int -------------------
_VITAE = "adet.modeling.vitae_v2"


@register_patch("vitae-window-batch",
                function=tuple(f"{_VITAE}.{m}.window_reverse" for m in ("window", "NormalCell", "ReductionCell")),
                why="window_reverse computes the batch as int(windows / windows per image): a batch of 1 baked "
                    "(a batch of two is wrong)")
def vitae_window_reverse(parts, window_size, H, W):
    if not _traced(H, W):
        return NotImplemented
    return windows.reverse(parts, window_size, H, W)
