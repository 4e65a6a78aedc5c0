"""Multi-scale deformable attention as DPText-DETR ships it. Upstream's file is AdelaiDet's (TESTR's) unchanged, so
the classes are the testr stand-in's; DPText-DETR's own part is the import of its package's compiled extension
(upstream: ``from adet import _C``), which fails unless something provides it."""
from dptext import _C  # noqa: F401
from testr.layers.ms_deform_attn import MSDeformAttn, _MSDeformAttnFunction, ms_deform_attn_core_pytorch  # noqa: F401
