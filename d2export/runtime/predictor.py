"""The onnxruntime predictor: a picture in its original size → the instances found, in that picture's pixels.

It reproduces detectron2's DefaultPredictor around the exported graph: the picture converted to the model's pixel
format, resized by ResizeShortestEdge(min_size_test, max_size_test), fed with the original size as the output size;
the graph returns coordinates in resized-input pixels, and the model's family (named by the manifest,
d2export/families) turns them into `Instance`s of the original picture. The session is built once; `run` is safe to
call from several threads. The work around the graph is `Processing`'s (processing.py); the Predictor adds the session.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from d2export.instances import Prediction
from d2export.kernels import custom_ops
from d2export.runtime import openvino_session
from d2export.runtime.bound_runs import BoundRuns
from d2export.runtime.model_loading import ModelLoadError, check_schema, load_manifest
from d2export.runtime.optimized_cache import create_session
from d2export.runtime.processing import Prepared, Processing, equal_size_groups
from d2export.runtime.providers import (PROVIDERS, ProviderUnavailable, disabled_optimizers, exact_int8,
                                        resolve_providers, serving_settings)

log = logging.getLogger("d2export")


def _no_cuda_graphs(runs_on: str) -> None:
    log.warning("cuda graphs: not used: they need the CUDA provider (the session runs on %s)", runs_on)


class Predictor(Processing):
    def __init__(self, model_path: str | os.PathLike, providers: Sequence[str] = ("cpu",), threads: int = 0,
                 score_threshold: float | None = None, provider_options: Sequence[dict] | None = None,
                 min_size: int | None = None, max_size: int | None = None, verify_hash: bool = True,
                 embedded_manifest: bool = False, tf32: bool = False, cuda_graph: bool = False):
        """`threads`: onnxruntime's intra-op threads (0: its default, one per core). `provider_options` (one dict per
        provider) go over `serving_settings`'s defaults (on CUDA `cuda_options` for the graph's precision: TF32 off
        for float32 unless `tf32`). The manifest
        (`model.manifest.json` beside the model) says everything else; see `Processing` for the overrides. The model
        must be the one its manifest describes (its sha256 unless `verify_hash=False`, and its inputs and outputs),
        else ModelLoadError. `embedded_manifest`: a model without a manifest beside it is served from the copy in its
        own metadata_props (a lone model.onnx); by default such a model is refused (an interrupted export).
        `cuda_graph`: on the CUDA provider, replay onnxruntime's CUDA graphs (one captured per batch and size, inputs
        and outputs in fixed device buffers: `BoundRuns`) where onnxruntime accepts the graph (every node on the CUDA
        provider: a fixed-size export), tried first; elsewhere it serves as without, after one line in the log.
        A manifest of runtime "openvino" is served by OpenVINO on the CPU (`openvino_session.py`; `threads` its
        threads): precision bfloat16 (export.bf16) in bfloat16, refused in one line on a CPU without it; int8
        (export.runtime=openvino) with its quantised products in int8 and the rest in float32."""
        import onnxruntime as ort

        self.model_path, self.threads = Path(model_path), int(threads)
        super().__init__(load_manifest(self.model_path, verify_hash, embedded_manifest), score_threshold, min_size,
                         max_size)
        if self.manifest.runtime == "openvino":  # export.bf16, or int8 asked so: OpenVINO serves it
            self._openvino_session(providers, cuda_graph)
            return

        options = ort.SessionOptions()
        options.intra_op_num_threads = int(threads)
        options.log_severity_level = 3
        try:
            custom_ops.register(options, self.manifest.custom_ops)
            self.msda_kernel = custom_ops.serving_kernel(self.manifest.custom_ops)  # for metadata()
        except custom_ops.MissingExtra as e:
            raise ProviderUnavailable(str(e)) from None
        self.providers = resolve_providers(providers)
        per_provider = serving_settings(options, self.providers, self.manifest.precision, tf32, provider_options)
        self.session, self.bound = self._cuda_graph_session(options, per_provider) if cuda_graph else (None, None)
        if self.session is None:
            try:
                self.session = create_session(self.model_path, options, self.providers, provider_options=per_provider)
            except Exception as e:  # noqa: BLE001 - onnxruntime's protobuf/graph errors span many lines and types
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ModelLoadError(f"{self.model_path}: not a loadable ONNX model ({first[:300]})") from None
        check_schema(self.model_path, self.manifest, self.session)
        # the kernel that really serves: the CUDA one where onnxruntime placed the session on its CUDA provider
        self.msda_kernel = custom_ops.serving_kernel(self.manifest.custom_ops, self.session.get_providers())

    def _openvino_session(self, providers: Sequence[str], cuda_graph: bool) -> None:
        """The session of a graph OpenVINO serves (manifest runtime "openvino"), on the CPU: a bfloat16 graph in
        bfloat16, refused in one line on a CPU without it (Bf16Unavailable); an int8 graph at OpenVINO's float32
        hint (what is quantised runs in int8). Refused in one line where another provider is asked for."""
        asked = [PROVIDERS.get(p.lower(), p) for p in providers]
        if any(p != PROVIDERS["cpu"] for p in asked) or cuda_graph:
            raise ProviderUnavailable(f"{self.model_path.name}: its {self.manifest.precision} graph is served by "
                                      "OpenVINO on the CPU: serve it with the cpu provider (for a GPU, export float16: "
                                      "export.fp16=true)")
        precision = self.manifest.precision
        if precision == "bfloat16":
            openvino_session.require_bf16(what=f"{self.model_path.name} (precision bfloat16, served by OpenVINO)")
        self.providers, self.bound, self.msda_kernel = [openvino_session.PROVIDER], None, None
        try:
            self.session = openvino_session.OpenVINOSession(self.model_path, precision, self.threads)
        except ProviderUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - OpenVINO's reading errors span many lines and types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"{self.model_path}: OpenVINO cannot load this model ({first[:300]})") from None
        check_schema(self.model_path, self.manifest, self.session)

    def _cuda_graph_session(self, options, per_provider: list[dict]) -> tuple[Any, BoundRuns | None]:
        """A session that captures CUDA graphs and its runner, built first so that a graph onnxruntime accepts costs
        one session, not two; (None, None), after one line in the log, where onnxruntime refuses it (the plain session
        is built then), or (the session, None) where it came up without the CUDA provider."""
        cuda = PROVIDERS["cuda"]
        if cuda not in self.providers:  # the plain session, built next, runs on the first one asked for
            _no_cuda_graphs(self.providers[0])
            return None, None
        with_graphs = [dict(o) for o in per_provider]
        with_graphs[self.providers.index(cuda)]["enable_cuda_graph"] = "1"
        try:
            session = create_session(self.model_path, options, self.providers, provider_options=with_graphs)
        except Exception as e:  # noqa: BLE001 - onnxruntime says why in its message (nodes left to the CPU, copies)
            log.warning("cuda graphs: not used: onnxruntime refuses them for this graph (%s)",
                        (str(e).strip().splitlines() or [type(e).__name__])[0][:300])
            return None, None
        if session.get_providers()[0] != cuda:  # onnxruntime dropped a CUDA provider it could not load
            _no_cuda_graphs(session.get_providers()[0])
            return session, None
        device_id = int(session.get_provider_options().get(cuda, {}).get("device_id", 0))
        return session, BoundRuns(session, self.output_names, "cuda", device_id)

    # the graph -----------------------------------------------------------------------------------------------------
    def run(self, prepared: Sequence[Prepared]) -> dict[str, np.ndarray]:
        """One padded batch through the session: output name → array."""
        feeds = self.feeds(prepared)
        if self.bound:
            outputs = list(self.bound.run(feeds).values())
        else:
            outputs = self.session.run(self.output_names, feeds)
        # a float16 graph (export.fp16, keep_io_types=false) answers in float16: post-processing reads float32
        return {n: o.astype(np.float32) if o.dtype == np.float16 else o for n, o in zip(self.output_names, outputs)}

    # all together --------------------------------------------------------------------------------------------------
    def predict_prepared(self, prepared: Sequence[Prepared],
                         score_thresholds: Sequence[float | None] | None = None) -> list[Prediction]:
        """Pictures → predictions: one session run, or one per `max_batch` pictures where the graph's batch is fixed."""
        thresholds = list(score_thresholds or [None] * len(prepared))
        step = self.max_batch or max(len(prepared), 1)
        found = []
        for start in range(0, len(prepared), step):
            chunk = list(prepared[start : start + step])
            outputs = self.run(chunk)
            found += [self.postprocess(outputs, i, p, t) for i, (p, t) in enumerate(zip(chunk, thresholds[start:]))]
        return found

    def predict_unpadded(self, prepared: Sequence[Prepared],
                         score_thresholds: Sequence[float | None] | None = None) -> list[Prediction]:
        """As `predict_prepared`, but only pictures of one size share a run: none is padded for a batch-mate, so each
        gets the answer it gets alone (a padded batch changes a DETR's answers: its attention sees the padding)."""
        thresholds = list(score_thresholds or [None] * len(prepared))
        found: list[Prediction] = [None] * len(prepared)  # type: ignore[list-item]
        for group in equal_size_groups(prepared):
            runs = self.predict_prepared([prepared[i] for i in group], [thresholds[i] for i in group])
            for i, prediction in zip(group, runs):
                found[i] = prediction
        return found

    def predict_batch(self, images: Sequence[np.ndarray], format: str = "RGB",
                      score_threshold: float | None = None) -> list[Prediction]:
        """Several pictures, one session run: mixed sizes are zero-padded to a common size, as detectron2 batches."""
        return self.predict_prepared([self.prepare(im, format) for im in images], [score_threshold] * len(images))

    def predict(self, image: np.ndarray, format: str = "RGB", score_threshold: float | None = None) -> Prediction:
        return self.predict_batch([image], format, score_threshold)[0]

    __call__ = predict

    def providers_line(self) -> str:
        """What the session really runs on, for the console: onnxruntime drops a provider it cannot load (CUDA without
        its libraries) with no error, and TF32 decides whether the CUDA provider serves what was verified."""
        running = self.session.get_providers()
        options = self.session.get_provider_options()
        shown = [p + (" (TF32 on)" if options.get(p, {}).get("use_tf32") == "1" else "") for p in running]
        dropped = [p for p in self.providers if p not in running]
        return "running on " + ", ".join(shown) + (f"; not available: {', '.join(dropped)}" if dropped else "")

    def metadata(self) -> dict[str, Any]:
        m = self.manifest
        return {"model": self.model_path.name, "family": m.family, "sha256": m.sha256, "opset": m.opset,
                "exporter": m.exporter, "sampler": m.sampler, "precision": m.precision, "msda_kernel": self.msda_kernel,
                "cuda_graph": self.bound is not None,
                "providers": self.session.get_providers(),  # what the session runs on, not what was asked
                "provider_options": self.session.get_provider_options(),
                "disabled_optimizers": disabled_optimizers(self.session), "exact_int8": exact_int8(self.session),
                "inputs": [asdict(t) for t in m.inputs], "outputs": [asdict(t) for t in m.outputs],
                "preprocess": m.preprocess | {"min_size_test": self.min_size, "max_size_test": self.max_size},
                "postprocess": m.postprocess | {"score_threshold": self.score_threshold},
                "versions": m.versions}
