"""Import the user's code (with the compiled-op stand-ins in place), build their detectron2 model, load weights."""
from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from d2export.config import ModelConfig, PluginConfig

log = logging.getLogger(__name__)


class UserError(RuntimeError):
    """A problem with the user's input (config, files, code): reported in one line, without a traceback."""


def _call_path(spec: str):
    module, _, attr = spec.partition(":")
    if not attr:
        raise UserError(f"model.cfg_factory={spec!r}: write it as 'module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"model.cfg_factory={spec!r} cannot be loaded: {e}") from e


def import_user_code(model: ModelConfig, plugin: PluginConfig, root: Path) -> None:
    from d2export.patching import compiled_ops

    compiled_ops.install(plugin.compiled_ops)
    for entry in model.sys_path:
        path = str((root / entry).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
    for name in model.imports:
        try:
            importlib.import_module(name)
        except Exception as e:
            raise UserError(f"model.imports: importing {name!r} failed: {type(e).__name__}: {e}") from e


def load_config(model: ModelConfig, root: Path) -> Any:
    """The model's own config: a yacs CfgNode (model.d2_config) or a LazyConfig (model.lazy_config)."""
    if model.lazy_config is None:
        return load_d2_config(model, root)
    from d2export import lazyconfig

    try:
        return lazyconfig.load(root / model.lazy_config, model.lazy_overrides)
    except lazyconfig.LazyConfigError as e:
        raise UserError(str(e)) from e


def load_d2_config(model: ModelConfig, root: Path) -> Any:
    path = root / model.d2_config
    if not path.is_file():
        raise UserError(f"model.d2_config: no such file: {path}")
    cfg = _call_path(model.cfg_factory)()
    try:
        cfg.merge_from_file(str(path))
        cfg.merge_from_list(list(model.opts))
    except (KeyError, ValueError, AssertionError) as e:
        raise UserError(f"model.d2_config {path.name}: {e}") from e
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.WEIGHTS = ""
    cfg.freeze()
    return cfg


def _instantiate(model: ModelConfig, d2cfg: Any) -> torch.nn.Module:
    if model.lazy_config is not None:
        from d2export import lazyconfig

        try:
            return lazyconfig.build(d2cfg)
        except lazyconfig.LazyConfigError as e:
            raise UserError(str(e)) from e
    from detectron2.modeling import META_ARCH_REGISTRY
    from detectron2.modeling import build_model as d2_build

    arch = d2cfg.MODEL.META_ARCHITECTURE
    if arch not in META_ARCH_REGISTRY:
        known = ", ".join(sorted(k for k, _ in META_ARCH_REGISTRY))
        raise UserError(f"unknown meta-architecture {arch!r} (is model.imports right?); registered: {known}")
    return d2_build(d2cfg)


def build_model(model: ModelConfig, d2cfg: Any, root: Path) -> torch.nn.Module:
    torch.manual_seed(model.seed)
    net = _instantiate(model, d2cfg).eval()
    if model.weights:
        path = root / model.weights
        if not path.is_file():
            raise UserError(f"model.weights: no such file: {path}")
        from detectron2.checkpoint import DetectionCheckpointer

        DetectionCheckpointer(net).load(str(path))
    else:
        log.warning("!" * 72)
        log.warning("model.weights is not set: exporting SEEDED RANDOM WEIGHTS (seed %d). The graph is real; its "
                    "answers are not.", model.seed)
        log.warning("!" * 72)
    return net
