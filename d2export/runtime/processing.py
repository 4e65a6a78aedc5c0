"""What happens around the graph, without a session: a picture prepared for it (pixel format, resize, pad into a
batch) and the graph's outputs turned into instances by the model's family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from d2export import families
from d2export.instances import Prediction
from d2export.manifest import Manifest
from d2export.resizing import pad_batch, resize_shortest_edge, resized_shape
from d2export.runtime.image_decoding import UnusableImage

PIXEL_FORMATS = ("RGB", "BGR")


@dataclass
class Prepared:
    """One picture ready for the graph: CHW uint8 in the model's pixel format, resized, and its original size."""

    chw: np.ndarray
    height: int
    width: int


def equal_size_groups(prepared: Iterable[Prepared]) -> list[list[int]]:
    """Indices grouped by the pictures' size in the graph (first appearance first)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prepared):
        groups.setdefault(p.chw.shape, []).append(i)
    return list(groups.values())


class Processing:
    """The model's pre- and post-processing as its manifest describes them, without a session: cheap to build and to
    pickle, so Ray tasks and Triton's Python backend run the very code the predictor runs."""

    def __init__(self, manifest: Manifest, score_threshold: float | None = None, min_size: int | None = None,
                 max_size: int | None = None):
        """`score_threshold`, `min_size` and `max_size` override the manifest's (as INPUT.MIN_SIZE_TEST/MAX_SIZE_TEST
        would: the graph takes any size)."""
        self.manifest = manifest
        self.family = families.get(manifest.family)
        pre, post = manifest.preprocess, manifest.postprocess
        self.input_format = pre.get("input_format", "BGR")
        if self.input_format not in PIXEL_FORMATS:
            raise ValueError(f"model pixel format {self.input_format!r} is not supported ({PIXEL_FORMATS})")
        self.min_size = int(pre.get("min_size_test", 0) if min_size is None else min_size)
        self.max_size = int(pre.get("max_size_test", 0) if max_size is None else max_size)
        self.score_threshold = float(post.get("score_threshold", 0.0) if score_threshold is None else score_threshold)
        self.post = dict(post)
        self.input_dtypes = {t.name: np.dtype(t.dtype) for t in manifest.inputs}
        self.output_names = [t.name for t in manifest.outputs]
        # a graph whose batch axis is a number (detectron2's own detectors: 1) takes at most that many pictures a run
        fixed = [t.shape[0] for t in manifest.inputs if t.shape and isinstance(t.shape[0], int)]
        self.max_batch = min(fixed) if fixed else None
        # a fixed-size graph (export.dynamic=false) takes pictures of its size only: resized to fit it (the longer
        # side at most its shorter one) and zero-padded to it, its batch filled with blank pictures
        images = next((t for t in manifest.inputs if t.name == "images"), None)
        shape = list(images.shape) if images and images.shape else []
        self.fixed = tuple(shape[:1] + shape[2:4]) if len(shape) == 4 and all(
            isinstance(d, int) for d in shape[:1] + shape[2:4]) else None
        # where torch.export narrowed the graph to a least size and it answered differently below (the export's lint)
        self.min_input_size = tuple(int(v) for v in pre.get("min_input_size", (0, 0)))
        # where the model's own code runs only at multiples of a size (found at export): each batch padded up to them
        self.size_divisibility = int(pre.get("size_divisibility", 0))
        if self.fixed:
            side = min(self.fixed[1:])
            self.min_size, self.max_size = min(self.min_size or side, side), min(self.max_size or side, side)

    # pre-processing ------------------------------------------------------------------------------------------------
    def prepare(self, image: np.ndarray, format: str = "RGB") -> Prepared:
        """HWC uint8 (or HW grey) in `format` → the graph's input for it."""
        image = np.asarray(image)
        if image.ndim == 2:
            image = np.repeat(image[:, :, None], 3, axis=2)
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected an HxWx3 uint8 picture, got {image.dtype} {image.shape}")
        if image.shape[0] == 0 or image.shape[1] == 0:
            raise ValueError(f"picture has zero size {image.shape[:2]}")
        if format not in PIXEL_FORMATS:
            raise ValueError(f"format {format!r}: choose one of {PIXEL_FORMATS}")
        if format != self.input_format:
            image = image[:, :, ::-1]
        h, w = image.shape[:2]
        if min(resized_shape(h, w, self.min_size, self.max_size)) < 1:
            raise UnusableImage(f"picture is {w}x{h}: its aspect ratio is too extreme to resize to "
                                f"{self.min_size}..{self.max_size} px (a side would be 0 px)")
        resized = resize_shortest_edge(np.ascontiguousarray(image), self.min_size, self.max_size)
        return Prepared(np.ascontiguousarray(resized.transpose(2, 0, 1)), image.shape[0], image.shape[1])

    def feeds(self, prepared: Sequence[Prepared]) -> dict[str, np.ndarray]:
        """Pictures → the graph's inputs for one batch, zero-padded to a common size, in the graph's dtypes."""
        if self.max_batch and len(prepared) > self.max_batch:
            raise ValueError(f"this graph takes at most {self.max_batch} picture(s) per run (its input batch is fixed; "
                             "predict_batch splits larger batches)")
        images, sizes = pad_batch([p.chw for p in prepared], self.fixed, self.min_input_size, self.size_divisibility)
        feeds = {"images": images, "image_sizes": sizes}
        return {name: feeds[name].astype(dtype, copy=False) for name, dtype in self.input_dtypes.items()}

    # post-processing -----------------------------------------------------------------------------------------------
    def postprocess(self, outputs: dict[str, np.ndarray], index: int, prepared: Prepared,
                    score_threshold: float | None = None) -> Prediction:
        """Row `index` of a batch's outputs → the picture's instances, by the model's family: thresholded (≥),
        coordinates back in the original picture's pixels."""
        return self.prediction(outputs, index, prepared.chw.shape[1:], (prepared.height, prepared.width),
                               score_threshold)

    def prediction(self, outputs: dict[str, np.ndarray], index: int, input_hw: Sequence[int],
                   original_hw: Sequence[int], score_threshold: float | None = None) -> Prediction:
        """As `postprocess`, given the picture's size in the graph (resized, unpadded) and its original size."""
        threshold = self.score_threshold if score_threshold is None else score_threshold
        height, width = map(int, original_hw)
        return self.family.prediction(outputs, index, tuple(map(int, input_hw)), (height, width), self.post,
                                      threshold)
