"""A detrex-layout stand-in written for d2export's tests (see third_party/README.md). Not IDEA-Research's code.

The compiled extension `detrex._C` is not shipped: `detrex.layers.multi_scale_deform_attn` imports it and, as
upstream, degrades `MultiScaleDeformableAttention` to a class that refuses to build when it is missing.
"""
__version__ = "0.0.0+standin"
