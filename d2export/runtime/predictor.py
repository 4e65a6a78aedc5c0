"""The onnxruntime predictor: a picture in its original size → the instances found, in that picture's pixels.

It reproduces detectron2's DefaultPredictor around the exported graph: the picture converted to the model's pixel
format, resized by ResizeShortestEdge(min_size_test, max_size_test), fed with the original size as the output size;
the graph returns coordinates in resized-input pixels, and the model's family (named by the manifest,
d2export/families) turns them into `Instance`s of the original picture. The session is built once; `run` is safe to
call from several threads.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from d2export import families
from d2export.resizing import pad_batch, resize_shortest_edge, resized_shape
from d2export.instances import Instance, Prediction, TextInstance  # noqa: F401 - the runtime's public types
from d2export.manifest import Manifest, manifest_path, sha256_file
from d2export.kernels import custom_ops
from d2export.runtime.bound_runs import BoundRuns
from d2export.runtime.image_decoding import UnusableImage
from d2export.runtime.optimized_cache import create_session

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
PIXEL_FORMATS = ("RGB", "BGR")
log = logging.getLogger("d2export")
ORT_TYPE_NAMES = {"float32": "float", "float64": "double"}  # numpy dtype names onnxruntime spells otherwise


class ProviderUnavailable(RuntimeError):
    pass


class ModelLoadError(ValueError):
    """The model or its manifest is missing, unreadable or not the pair they claim to be: one line, naming the file."""


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


def resolve_providers(names: Sequence[str]) -> list[str]:
    """Short names (cpu, cuda, tensorrt) or onnxruntime's own → provider names, refusing any not installed.
    The CPU provider is appended as the fallback for nodes the others do not take."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    chosen = []
    for name in names:
        full = PROVIDERS.get(name.lower(), name)
        if full not in available:
            hint = " (install onnxruntime-gpu with a matching CUDA/TensorRT)" if full != PROVIDERS["cpu"] else ""
            raise ProviderUnavailable(f"execution provider {name!r} ({full}) was asked for, but this onnxruntime "
                                      f"{ort.__version__} offers only {', '.join(available)}{hint}")
        chosen.append(full)
    return list(dict.fromkeys(chosen + [PROVIDERS["cpu"]]))


# onnxruntime's graph transformer that turns MatMul + Add on known shapes into Gemm: on CUDA the Gemm first writes its
# bias into the output with a broadcast kernel (`BroadcastBiasKernel`: 6.4 of 62.8 ms a call measured, float16 batch
# 8 on an H200), then cuBLAS adds the product to it; without the fusion the bias is one elementwise Add
DISABLED_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"  # a session config entry, names joined by ;
CUDA_DISABLED_OPTIMIZERS = ("MatMulAddFusion",)
# The CPU's own sessions: that Gemm and onnxruntime's SkipLayerNormalization (Add + LayerNormalization) measured
# slower than the nodes they replace on the CPU, in torch.export's graphs (2D linears, where TorchScript's are 3D and
# meet neither): R-50 TESTR 640², fused, 2 threads, Intel Xeon AVX-512/AMX: 1238 -> 1176 ms (TorchScript's graph
# 1147 -> 1149); gather 1941 -> 1902 ms (1836 -> 1845)
CPU_DISABLED_OPTIMIZERS = ("MatMulAddFusion", "SkipLayerNormFusion")


def cuda_options(precision: str = "float32", tf32: bool = False) -> dict[str, str]:
    """The CUDA provider's options d2export serves a graph of `precision` with (the manifest's: float32, float16,
    int8). `use_tf32`: a float32 graph is served in float32, as verified (TF32's 10 mantissa bits swap a two-stage
    model's near-tied proposals: measured on R-50 TESTR, whole detections 624 px apart) unless `tf32`; a float16
    graph gets it on, because onnxruntime's cuDNN-9 convolutions leave out the tensor-core engines whenever it is off,
    float16 ones included (TF32 touches only float32 arithmetic: the nodes a float16 graph keeps in float32, Softmax
    and MSDA's sampling, have float16's 10 mantissa bits anyway). `fuse_conv_bias`: cuDNN adds a convolution's bias in
    the same kernel instead of a second one. `prefer_nhwc`: channels-last convolutions, the tensor cores' layout, where
    they run (float16, or TF32). Proposed from onnxruntime's source; their GPU figures are `tools/benchmark.py gpu`'s
    rows (docs/gpu.md)."""
    tensor_cores = tf32 or precision == "float16"
    on = "1" if tensor_cores else "0"
    return {"use_tf32": on, "fuse_conv_bias": "1", "prefer_nhwc": on}


def options_per_provider(providers: Sequence[str], tf32: bool = False, given: Sequence[dict] | None = None,
                         precision: str = "float32") -> list[dict]:
    """Each provider's options: `given` (one dict per provider, in order) over d2export's defaults (on CUDA
    `cuda_options(precision, tf32)`), so the provider serves what verification compared."""
    given = list(given or [])
    given += [{}] * (len(providers) - len(given))
    return [(cuda_options(precision, tf32) if p == PROVIDERS["cuda"] else {}) | dict(g)
            for p, g in zip(providers, given)]


def serving_settings(options, providers: Sequence[str], precision: str = "float32", tf32: bool = False,
                     given: Sequence[dict] | None = None) -> list[dict]:
    """What a session of `providers` serving a graph of `precision` gets, for the Predictor and for verification
    alike: `options` (onnxruntime SessionOptions) with `CUDA_DISABLED_OPTIMIZERS` turned off where CUDA serves,
    `CPU_DISABLED_OPTIMIZERS` where the CPU alone does; returns each provider's options (`options_per_provider`)."""
    off = CUDA_DISABLED_OPTIMIZERS if PROVIDERS["cuda"] in providers else CPU_DISABLED_OPTIMIZERS
    options.add_session_config_entry(DISABLED_OPTIMIZERS_KEY, ";".join(off))
    return options_per_provider(providers, tf32, given, precision)


def _no_cuda_graphs(runs_on: str) -> None:
    log.warning("cuda graphs: not used: they need the CUDA provider (the session runs on %s)", runs_on)


def disabled_optimizers(session) -> list[str]:
    """The graph transformers a session was built without (for metadata and the manifest)."""
    try:
        value = session.get_session_options().get_session_config_entry(DISABLED_OPTIMIZERS_KEY)
    except RuntimeError:  # onnxruntime's answer for an entry never set
        return []
    return [name for name in value.split(";") if name]


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
        provider: a fixed-size export), tried first; elsewhere it serves as without, after one line in the log."""
        import onnxruntime as ort

        self.model_path, self.threads = Path(model_path), int(threads)
        super().__init__(load_manifest(self.model_path, verify_hash, embedded_manifest), score_threshold, min_size,
                         max_size)

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
                "disabled_optimizers": disabled_optimizers(self.session),
                "inputs": [asdict(t) for t in m.inputs], "outputs": [asdict(t) for t in m.outputs],
                "preprocess": m.preprocess | {"min_size_test": self.min_size, "max_size_test": self.max_size},
                "postprocess": m.postprocess | {"score_threshold": self.score_threshold},
                "versions": m.versions}


def load_manifest(model_path: Path, verify_hash: bool = True, embedded: bool = False) -> Manifest:
    """The manifest beside `model_path`, checked to describe that very file (by sha256 unless told not to); with
    `embedded`, a model without one beside it answers with the copy inside it."""
    if not model_path.is_file():
        raise ModelLoadError(f"model file not found: {model_path}")
    path = manifest_path(model_path)
    if embedded and not path.exists():
        return Manifest.from_model(model_path)
    if not path.is_file():
        raise ModelLoadError(f"{model_path} has no manifest beside it ({path.name} not found; an export into that "
                             "folder may have been interrupted: rerun it)")
    try:
        manifest = Manifest.read(path)
    except (ValueError, TypeError, KeyError) as e:  # bad JSON, missing or unknown fields
        raise ModelLoadError(f"{path}: not a readable d2export manifest ({type(e).__name__}: {e})") from None
    if verify_hash:
        actual = sha256_file(model_path)
        if manifest.sha256 != actual:
            raise ModelLoadError(f"{model_path} is not the model {path.name} describes: sha256 {actual[:16]}… vs "
                                 f"{(manifest.sha256 or 'none')[:16]}… recorded (pass --no-verify-hash to skip)")
    return manifest


def check_schema(model_path: Path, manifest: Manifest, session) -> None:
    """The graph's inputs and outputs must be the manifest's: names, element types and ranks."""
    def ours(specs):
        return [(t.name, f"tensor({ORT_TYPE_NAMES.get(t.dtype, t.dtype)})", len(t.shape)) for t in specs]

    def theirs(args):
        return [(a.name, a.type, len(a.shape)) for a in args]

    for kind, want, got in (("inputs", ours(manifest.inputs), theirs(session.get_inputs())),
                            ("outputs", ours(manifest.outputs), theirs(session.get_outputs()))):
        if want != got:
            diff = next((w, g) for w, g in zip(want + [None] * len(got), got + [None] * len(want)) if w != g)
            raise ModelLoadError(f"{model_path}: graph {kind} differ from {manifest_path(model_path).name} "
                                 f"(manifest {diff[0]}, graph {diff[1]})")


def add_predictor_arguments(ap) -> None:
    """The command-line options every serving command shares (argparse)."""
    ap.add_argument("model", help="the exported .onnx (its manifest lies beside it)")
    ap.add_argument("--providers", default="cpu", help="comma-separated: cpu, cuda, tensorrt (in priority order)")
    ap.add_argument("--tf32", action="store_true",
                    help="cuda: let onnxruntime compute in TF32 (faster on Ampere and later, but not what the export "
                         "verified: near-tied detections may change)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="cuda: replay CUDA graphs (one per batch and size) where onnxruntime accepts the graph "
                         "(a fixed-size export: export.dynamic=false); otherwise serves without, saying why")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: one per core)")
    ap.add_argument("--score-threshold", type=float, default=None, help="lowest score kept (default: the manifest's)")
    ap.add_argument("--min-size", type=int, default=None, help="shortest edge to resize to (default: the manifest's)")
    ap.add_argument("--max-size", type=int, default=None, help="longest edge cap (default: the manifest's)")
    ap.add_argument("--no-verify-hash", action="store_true",
                    help="skip checking the model's sha256 against its manifest (huge files); inputs and outputs "
                         "are still checked")
    ap.add_argument("--embedded-manifest", action="store_true",
                    help="serve a model.onnx that has no manifest beside it from the copy inside it (without this, "
                         "a lone model is refused as what an interrupted export leaves)")


def predictor_from_args(args) -> Predictor:
    return Predictor(args.model, args.providers.split(","), args.threads, args.score_threshold,
                     min_size=args.min_size, max_size=args.max_size, verify_hash=not args.no_verify_hash,
                     embedded_manifest=args.embedded_manifest, tf32=args.tf32,
                     cuda_graph=getattr(args, "cuda_graph", False))
