"""Import the user's code (with the compiled-op stand-ins in place), build their detectron2 model, load weights."""
from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from d2export.config import ModelConfig, PluginConfig, lazy_config_path
from d2export.config import UserError  # noqa: F401 - raised here, caught by callers

log = logging.getLogger(__name__)




def resolve_device(name: str, option: str = "export.device=") -> str:
    """export.device (or another `option` naming a device) → a torch device name: auto is cuda where torch sees a
    GPU, else cpu."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            raise UserError(f"{option}{name}: torch {torch.__version__} sees {count} CUDA device(s) (built for "
                            f"CUDA {torch.version.cuda or 'none'}); use {option}cpu or auto")
    return name


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off for CUDA's matrix products and convolutions while inside: 10 mantissa bits are enough to swap a
    two-stage model's near-tied proposals (measured on R-50 TESTR on an H100: 624 px between eager CUDA and the CPU
    graph with TF32, 9e-9 without), and the references must be what onnxruntime computes in float32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _call_path(spec: str, key: str = "model.cfg_factory"):
    module, _, attr = spec.partition(":")
    if not attr:
        raise UserError(f"{key}={spec!r}: write it as 'module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{key}={spec!r} cannot be loaded: {e}") from e


@contextlib.contextmanager
def quiet_imports():
    """fvcore and detectron2 call torch.jit.script at import, which newer torch answers with a FutureWarning of two
    lines each, printed before any export output or error: noise about libraries, not about the user's model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        yield


def import_user_code(model: ModelConfig, plugin: PluginConfig, root: Path) -> None:
    from d2export.patching import compiled_ops

    with quiet_imports():
        compiled_ops.install(plugin.compiled_ops, plugin.import_only)
    for entry in model.sys_path:
        path = str((root / entry).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
    for name in model.imports:
        try:
            with quiet_imports():  # user code scripted at import: torch's notice says nothing about this model
                importlib.import_module(name)
        except Exception as e:
            raise UserError(f"model.imports: importing {name!r} failed: {type(e).__name__}: {e}") from e


def load_config(model: ModelConfig, root: Path, device: str = "cpu") -> Any:
    """The model's own config: a yacs CfgNode (model.d2_config, its MODEL.DEVICE set to `device`) or a LazyConfig
    (model.lazy_config)."""
    if model.lazy_config is None:
        return load_d2_config(model, root, device)
    from d2export import lazyconfig

    path = lazy_config_path(root, model.lazy_config)
    if path != root / model.lazy_config:
        log.warning("model.lazy_config=%s: no such file; using %s, the one file of that name nearby", model.lazy_config,
                    path)
    try:
        return lazyconfig.load(path, model.lazy_overrides)
    except lazyconfig.LazyConfigError as e:
        raise UserError(str(e)) from e


def load_d2_config(model: ModelConfig, root: Path, device: str = "cpu") -> Any:
    path = d2_config_path(model.d2_config, root)
    d2cfg = _call_path(model.cfg_factory)()
    for adder in model.cfg_adders:
        _call_path(adder, "model.cfg_adders")(d2cfg)
    try:
        d2cfg.merge_from_file(str(path))
        d2cfg.merge_from_list(list(model.opts))
    except (KeyError, ValueError, AssertionError) as e:
        raise UserError(f"model.d2_config {path.name}: {e}") from e
    d2cfg.MODEL.DEVICE = device  # TESTR-style models keep it and move their inputs there
    d2cfg.MODEL.WEIGHTS = ""
    d2cfg.freeze()
    return d2cfg


def charset_search(model: ModelConfig, root: Path) -> list[Path]:
    """Where a relative dictionary path in the model's config may lie, after the working directory the model's own
    tools open it from: the folders on model.sys_path (a clone's root), then the model config's folder and those
    above it (configs/R_50/ReCTS/ lies inside the clone)."""
    folders = [(root / p).resolve() for p in model.sys_path]
    if model.d2_config and (root / model.d2_config).exists():
        folders += list((root / model.d2_config).resolve().parents)
    return list(dict.fromkeys(folders))


def d2_config_path(name: str, root: Path) -> Path:
    """A YAML path (relative to `root`), or a name inside detectron2's model zoo
    (`COCO-Detection/retinanet_R_50_FPN_1x.yaml`)."""
    path = root / name
    if path.is_file():
        return path
    from detectron2 import model_zoo

    try:
        return Path(model_zoo.get_config_file(name))
    except RuntimeError:
        raise UserError(f"model.d2_config: no such file: {path}, nor {name!r} in detectron2's model zoo") from None


def _instantiate(model: ModelConfig, d2cfg: Any) -> torch.nn.Module:
    if model.lazy_config is not None:
        from d2export import lazyconfig

        try:
            return lazyconfig.build(d2cfg)
        except lazyconfig.LazyConfigError as e:
            raise UserError(str(e)) from e
    with quiet_imports():
        from detectron2.modeling import META_ARCH_REGISTRY
        from detectron2.modeling import build_model as d2_build

    arch = d2cfg.MODEL.META_ARCHITECTURE
    if arch not in META_ARCH_REGISTRY:
        known = ", ".join(sorted(k for k, _ in META_ARCH_REGISTRY))
        raise UserError(f"unknown meta-architecture {arch!r} (is model.imports right?); registered: {known}")
    return d2_build(d2cfg)


def build_model(model: ModelConfig, d2cfg: Any, root: Path, device: str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The model in eval mode on `device`, and what `load_weights` says about its weights."""
    torch.manual_seed(model.seed)
    net = _instantiate(model, d2cfg).to(device).eval()
    return net, load_weights(net, model, root)


def condition_seeded(net: torch.nn.Module, weights: dict, scales: dict[str, float], image=None) -> dict:
    """Seeded random weights made to look like a model's (a checkpoint is never touched): each parameter whose name
    holds a fragment of `scales` multiplied by its factor; with `image` (CHW uint8), every normalisation layer with
    fixed statistics rescaled so that, on that picture, its output has zero mean and unit deviation as a trained
    network's has (a random ResNet-50's activations grow into the thousands, and float noise with them). Returns
    the manifest's weights record."""
    if weights.get("path") is not None:
        return weights
    scaled = []
    with torch.no_grad():
        for name, p in net.named_parameters():
            factor = next((f for fragment, f in scales.items() if fragment in name), None)
            if factor is not None:
                p.mul_(factor)
                scaled.append(name)
    normalised = _normalise_norms(net, image) if image is not None else []
    if not scaled and not normalised:
        return weights
    log.info("seeded weights conditioned: %d parameters scaled (%s), %d normalisation layers set to unit outputs",
             len(scaled), ", ".join(f"{k} x{v:g}" for k, v in scales.items()), len(normalised))
    return weights | {"kind": "seeded (conditioned)", "conditioned": scaled, "normalised": normalised}


def _normalise_norms(net: torch.nn.Module, image) -> list[str]:
    """One eval forward of `image` through detectron2's interface; each FrozenBatchNorm2d / eval BatchNorm2d, as it
    runs, gets its affine weight and bias rescaled so its output on this picture is standardised (and passes the
    standardised output on, so the layers after it are set on what they will see)."""
    from detectron2.layers import FrozenBatchNorm2d

    norms = [(n, m) for n, m in net.named_modules() if isinstance(m, (FrozenBatchNorm2d, torch.nn.BatchNorm2d))]

    def standardise(module, _, out):
        mean, std = out.mean(), out.std().clamp_min(1e-6)
        module.weight.div_(std)
        module.bias.sub_(mean).div_(std)
        return (out - mean) / std

    handles = [m.register_forward_hook(standardise) for _, m in norms]
    try:
        with torch.no_grad():
            net([{"image": torch.from_numpy(np.ascontiguousarray(image)).float()}])
    finally:
        for h in handles:
            h.remove()
    return [n for n, _ in norms]


def load_weights(net: torch.nn.Module, model: ModelConfig, root: Path) -> dict:
    """Loads `model.weights` through detectron2's checkpointer (its key renaming and format support), insisting that
    it fits the model unless `model.strict_weights` is false. Returns the manifest's record of the weights."""
    if not model.weights:
        log.warning("!" * 72)
        log.warning("model.weights is not set: exporting SEEDED RANDOM WEIGHTS (seed %d). The graph is real; its "
                    "answers are not.", model.seed)
        log.warning("!" * 72)
        return {"path": None, "random_seed": model.seed, "kind": "seeded"}
    path = root / model.weights
    if not path.is_file():
        raise UserError(f"model.weights: no such file: {path}")
    from detectron2.checkpoint import DetectionCheckpointer

    from d2export.manifest import sha256_file

    class Checking(DetectionCheckpointer):
        """Keeps what did not fit for us to judge, instead of logging it as a warning."""

        incompatible = None

        def _load_model(self, checkpoint):
            self.incompatible = super()._load_model(checkpoint)
            return self.incompatible

        def _log_incompatible_keys(self, incompatible) -> None:
            pass

    checkpointer = Checking(net)
    try:
        checkpointer.load(str(path))
    except Exception as e:  # noqa: BLE001 - pickle/zip/torch errors alike: the file is not a checkpoint we can read
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"model.weights {path}: not a readable checkpoint ({type(e).__name__}: {first})") from None
    incompatible = checkpointer.incompatible
    # BatchNorm's step counter is read only in training: weights trained with frozen norms (FrozenBatchNorm2d keeps
    # none) fit a model whose norms are BatchNorm
    missing = [k for k in incompatible.missing_keys if not k.endswith(".num_batches_tracked")]
    fit = {"missing": missing, "unexpected": list(incompatible.unexpected_keys),
           "mismatched": [f"{k} {tuple(has)} vs model {tuple(wants)}"
                          for k, has, wants in incompatible.incorrect_shapes]}
    if any(fit.values()):
        summary = "; ".join(f"{len(names)} {kind} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
                            for kind, names in fit.items() if names)
        if model.strict_weights:
            raise UserError(f"model.weights {path} does not fit the model: {summary}; set model.strict_weights=false "
                            "to export anyway")
        log.warning("model.weights %s does not fit the model (model.strict_weights=false): %s", path, summary)
    return {"path": str(path), "sha256": sha256_file(path), "strict": model.strict_weights} | fit
