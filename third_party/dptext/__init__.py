"""A DPText-DETR-architecture text detector written for d2export (see third_party/README.md).

Like ymy-k/DPText-DETR's ``adet`` package, importing it imports the model code, which registers
``TransformerPureDetector`` in detectron2's META_ARCH_REGISTRY, and its attention module imports the compiled
extension ``dptext._C`` (upstream: ``adet._C``), which is not shipped.
"""
from dptext import modeling  # noqa: F401  (registers TransformerPureDetector)

__version__ = "0.1.0"
