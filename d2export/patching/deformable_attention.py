"""Registered export-time patches for deformable-attention detectors: the MSDA core and the AdelaiDet-lineage
size-general rewrites (see detr_sizes.py). They are needed for every target: without them a trace bakes sizes."""
from __future__ import annotations

import torch

from d2export.ops import detr_sizes, level_shapes
from d2export.ops.msda_modules import is_msda
from d2export.patching import msda_swap
from d2export.patching.registry import forward_args, module_where, register_patch


register_patch("msda-core", module=module_where(is_msda),
               why="compiled MSDA op: no CPU kernel, cannot be traced; the swap also drops a value-dependent assert",
               )(msda_swap.forward)


@register_patch("sizes-as-tensor", function="torch.as_tensor",
                why="torch.as_tensor([(h, w), …]) of traced sizes becomes a constant: stack the sizes instead")
def sizes_as_tensor(data, dtype=None, device=None):
    if isinstance(data, (list, tuple)) and level_shapes.holds_size(data):
        shapes = level_shapes.stack_sizes(data).to(dtype=dtype or torch.long, device=device)
        return level_shapes.remember(shapes, data) if _is_level_list(data) else shapes
    return NotImplemented


def _is_level_list(data) -> bool:
    return all(isinstance(x, (list, tuple)) and len(x) == 2 for x in data)


register_patch("padding-mask-from-sizes", module=module_where(detr_sizes.has_mask_out_padding),
               method="mask_out_padding",
               why="per-image int(np.ceil(h / stride)) bakes the dummy's image sizes into the padding masks",
               )(detr_sizes.mask_out_padding)


@register_patch("reference-points-per-level", module=module_where(detr_sizes.has_reference_points),
                method="get_reference_points",
                why="linspace over Python-int level sizes bakes the encoder's reference points")
def get_reference_points(self, spatial_shapes, valid_ratios, device):  # a static method upstream: no self there
    return detr_sizes.get_reference_points(spatial_shapes, valid_ratios, device)


register_patch("encoder-proposals-per-level", module=module_where(detr_sizes.has_encoder_proposals),
               method="gen_encoder_output_proposals",
               why="linspace and view over Python-int level sizes bake the two-stage encoder proposals",
               )(detr_sizes.gen_encoder_output_proposals)


register_patch("encoder-proposals-free-function",
               function=tuple(f"maskdino.{m}.gen_encoder_output_proposals"
                              for m in ("utils.utils", "modeling.transformer_decoder.maskdino_decoder")),
               why="MaskDINO's two-stage proposals read each level's size out of spatial_shapes (data under "
                   "torch.export: slicing by it fails) and linspace over it",
               )(detr_sizes.encoder_proposals)


def is_encoder_only(module) -> bool:
    """Mask2Former's (OneFormer's, MaskDINO's) MSDeformAttnTransformerEncoderOnly: a deformable encoder with a level
    embedding, forward(srcs, [masks,] pos_embeds), returning (memory, spatial_shapes, level_start_index[, ...])."""
    if not (hasattr(module, "encoder") and isinstance(getattr(module, "level_embed", None), torch.nn.Parameter)):
        return False
    names = forward_args(module)
    return names[:1] == ["srcs"] and names[-1:] == ["pos_embeds"]


@register_patch("level-sizes-for-torch-export", module=module_where(is_encoder_only),
                why="the pixel decoder splits the encoder's memory by level_start_index and views each level by "
                    "spatial_shapes, tensors of the level sizes: under torch.export their values are data (.item()), "
                    "and the view's guard fails; the same sizes as Python (symbolic) sizes read from the levels")
def level_sizes_for_torch_export(self, srcs, *args):
    if not torch.compiler.is_exporting():
        return NotImplemented  # TorchScript traces the tensors' values; eager code keeps its own
    out = list(type(self).forward(self, srcs, *args))
    sizes = [tuple(src.shape[-2:]) for src in srcs]
    starts = [0]
    for h, w in sizes[:-1]:
        starts.append(starts[-1] + h * w)
    out[1], out[2] = sizes, starts
    return tuple(out)
