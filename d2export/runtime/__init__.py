"""Serving an exported model: onnxruntime predictor, pictures, HTTP server, Triton model repository, batch jobs.

Imports neither torch nor detectron2: a serving image needs only onnxruntime, numpy and Pillow (FastAPI and uvicorn
for the server). Everything about the model comes from the manifest beside the .onnx file. Names resolve lazily so
`import d2export.runtime` costs nothing and the CLI can list these commands without importing a web framework.
"""
from __future__ import annotations

from importlib import import_module

_LAZY = {  # name → its module: one of the runtime's, or a dotted path from d2export's root (the served types)
    "Predictor": "predictor", "Prediction": "d2export.instances", "Instance": "d2export.instances",
    "TextInstance": "d2export.instances", "ProviderUnavailable": "providers", "Processing": "processing",
    "BadImage": "image_decoding", "decode_image": "image_decoding", "read_image": "image_decoding",
    "draw_prediction": "visualize", "create_app": "server", "write_repository": "triton", "parse_pbtxt": "triton",
    "OpenVINOSession": "openvino_session", "bf16_supported": "openvino_session",
}


def __getattr__(name: str):
    if name in _LAZY:
        module = _LAZY[name]
        return getattr(import_module(module if "." in module else f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def infer_main(argv: list[str] | None = None) -> int:
    """`d2export infer`: images or folders in, JSON lines out (and pictures with --vis)."""
    return import_module(f"{__name__}.infer").main(argv)


def serve_main(argv: list[str] | None = None) -> int:
    """`d2export serve`: the HTTP server."""
    return import_module(f"{__name__}.server").main(argv)


def batch_main(argv: list[str] | None = None) -> int:
    """`d2export batch`: a picture corpus through Ray Data, one row per picture."""
    return import_module(f"{__name__}.batch").main(argv)


def triton_main(argv: list[str] | None = None) -> int:
    """`d2export triton-repo`: a Triton Inference Server model repository."""
    return import_module(f"{__name__}.triton").main(argv)
