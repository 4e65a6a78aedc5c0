"""A DeepSolo-architecture text spotter written for d2export (see third_party/README.md).

Like ViTAE-Transformer/DeepSolo's ``adet`` package, importing it imports the model code, which registers
``TransformerPureDetector`` in detectron2's META_ARCH_REGISTRY, and its attention module imports the compiled
extension ``deepsolo._C`` (upstream: ``adet._C``), which is not shipped.
"""
from deepsolo import modeling  # noqa: F401  (registers TransformerPureDetector)

__version__ = "0.1.0"
