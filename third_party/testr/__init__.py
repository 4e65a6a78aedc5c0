"""A TESTR-architecture text spotter written for d2export (see third_party/README.md).

Like AdelaiDet's ``adet`` package, importing the package imports the model code, which registers
``TransformerDetector`` in detectron2's META_ARCH_REGISTRY and imports the compiled attention module
``testr._C``. That module is not shipped: something (d2export's import hook, or a test shim) must provide it.
"""
from testr import modeling  # noqa: F401  (registers TransformerDetector)

__version__ = "0.1.0"
