"""PyTorch and ONNX results side by side: the same pictures through the eager model and through its export, drawn
next to each other (`d2export diagnose --vis DIR`). Both sides share pre- and post-processing (the runtime's
`Predictor`), so what differs is the graph alone."""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from d2export.pipeline import Built, export
from d2export.tracing import torch_inputs


def side_by_side_pictures(built: Built, pictures: Sequence[tuple[str, np.ndarray]], out_dir: Path) -> list[Path]:
    """Export `built` (unverified, into a temporary folder), run each (name, HWC RGB uint8) picture through PyTorch
    and onnxruntime, and write `out_dir/<name>.png`: PyTorch left, ONNX right. Returns the files written."""
    from d2export.runtime.predictor import Predictor
    from d2export.runtime.visualize import draw_prediction, side_by_side

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="d2export-compare-") as tmp:
        cfg = built.cfg
        cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, output_dir=tmp, lint=False),
                                  verify=dataclasses.replace(cfg.verify, enabled=False))
        manifest = export(cfg, built=dataclasses.replace(built, cfg=cfg))
        predictor = Predictor(Path(tmp) / manifest.model_file, threads=1)
        names = [t.name for t in manifest.outputs]
        for name, image in pictures:
            prepared = predictor.prepare(image)
            with torch.no_grad():
                eager = built.adapter(*torch_inputs(built.adapter, [prepared.chw]))
            eager = dict(zip(names, (t.numpy() for t in eager)))
            left = draw_prediction(image, predictor.postprocess(eager, 0, prepared), title="PyTorch")
            right = draw_prediction(image, predictor.predict_prepared([prepared])[0], title="ONNX")
            path = out_dir / f"{name}.png"
            side_by_side([left, right]).save(path)
            written.append(path)
    return written
