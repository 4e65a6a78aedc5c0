"""d2export: detectron2 detectors with deformable attention, exported to ONNX and served.

This module stays light: `import d2export` (and `import d2export.runtime`) must not import torch or detectron2,
so a serving image needs only onnxruntime, numpy and Pillow.
"""
__version__ = "0.1.0"
