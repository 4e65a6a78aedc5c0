"""DETR's sine position encodings; upstream's file is AdelaiDet's unchanged (the testr stand-in's)."""
from testr.layers.pos_encoding import PositionalEncoding1D, PositionalEncoding2D  # noqa: F401
