"""The Python-backend models of the picture ensemble that `d2export triton-repo --pictures` writes:

    IMAGE (encoded bytes) → <name>_pre → images, image_sizes, input_sizes, original_sizes
                          → <name> (the ONNX graph) → its outputs
                          → <name>_post → INSTANCES (per picture, the JSON `d2export serve` answers: height, width,
                                          instances; a segmentation model's maps as base64 PNG)

Each stage's model.py imports `TritonPythonModel` from here, so Triton runs the runtime's own decoding, resizing and
family post-processing (`Processing`), read from the manifest beside model.py; the stage comes from the model's
config (parameter `d2export_stage`). `triton_python_backend_utils` exists only inside Triton's Python backend: it is
imported when a model is loaded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from d2export.manifest import Manifest
from d2export.runtime.image_decoding import BadImage, decode_image
from d2export.runtime.maps import prediction_json
from d2export.runtime.processing import Processing

STAGE = "d2export_stage"  # the config parameter naming the stage: "pre" or "post"
MANIFEST = "model.manifest.json"
IMAGE, INSTANCES = "IMAGE", "INSTANCES"  # the ensemble's input and output
INPUT_SIZES, ORIGINAL_SIZES = "input_sizes", "original_sizes"  # per picture: resized (unpadded) and original h, w


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        self.stage = config["parameters"][STAGE]["string_value"]
        if self.stage not in ("pre", "post"):
            raise ValueError(f"{STAGE} {self.stage!r}: expected 'pre' or 'post'")
        manifest = Manifest.read(Path(args["model_repository"]) / args["model_version"] / MANIFEST)
        self.processing = Processing(manifest)

    def execute(self, requests: list) -> list:
        """Each request on its own: a request's pictures are one batch (padded together, as in `predict_batch`);
        a picture that cannot be decoded fails its request with the reason."""
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            tensors = self.pre(request) if self.stage == "pre" else self.post(request)
        except BadImage as e:
            return self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(str(e)))
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(k, v) for k, v in tensors.items()])

    def _input(self, request, name: str) -> np.ndarray:
        return self.pb.get_input_tensor_by_name(request, name).as_numpy()

    def pre(self, request) -> dict[str, np.ndarray]:
        pictures = self._input(request, IMAGE).reshape(-1)
        prepared = [self.processing.prepare(decode_image(bytes(data)), "RGB") for data in pictures]
        return {**self.processing.feeds(prepared),
                INPUT_SIZES: np.array([p.chw.shape[1:] for p in prepared], np.int64),
                ORIGINAL_SIZES: np.array([(p.height, p.width) for p in prepared], np.int64)}

    def post(self, request) -> dict[str, np.ndarray]:
        outputs = {name: self._input(request, name) for name in self.processing.output_names}
        input_sizes, original_sizes = self._input(request, INPUT_SIZES), self._input(request, ORIGINAL_SIZES)
        found: list[Any] = [
            json.dumps(prediction_json(self.processing.prediction(outputs, i, input_sizes[i], original_sizes[i])),
                       ensure_ascii=False).encode() for i in range(len(original_sizes))]
        return {INSTANCES: np.array(found, dtype=object).reshape(-1, 1)}
