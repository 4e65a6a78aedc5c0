"""detectron2 LazyConfig models (detrex's form: a Python file with `model = L(DeformableDETR)(...)`): load with
overrides, build, and read what the manifest needs (pixel statistics from the model, pixel format and test-time
resize from the dataloader's test mapper, class names from the test dataset's metadata).

Torch is imported only by `build`; the readers take whatever `LazyConfig.load` returned.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence
from unittest import mock


class LazyConfigError(ValueError):
    """A LazyConfig file that cannot be loaded, overridden or read: reported in one line."""


def is_lazy(d2cfg: Any) -> bool:
    """A LazyConfig (an omegaconf DictConfig with a `model` node) rather than a yacs CfgNode."""
    from omegaconf import DictConfig

    return isinstance(d2cfg, DictConfig) and "model" in d2cfg


def load(path: Path, overrides: Sequence[str] = ()) -> Any:
    from detectron2.config import LazyConfig

    if not path.is_file():
        raise LazyConfigError(f"model.lazy_config: no such file: {path}")
    try:
        with checkout_configs(path):
            d2cfg = LazyConfig.load(str(path))
        d2cfg = LazyConfig.apply_overrides(d2cfg, list(overrides))
    except Exception as e:  # noqa: BLE001 - the config is user code: any failure is the user's to fix
        raise LazyConfigError(f"model.lazy_config {path.name}: {type(e).__name__}: {e}".replace("\n", " ")) from e
    if "model" not in d2cfg:
        raise LazyConfigError(f"model.lazy_config {path.name} defines no `model`")
    if "device" in d2cfg.model:  # detrex models default to "cuda"; export runs on the CPU
        d2cfg.model.device = "cpu"
    return d2cfg


@contextlib.contextmanager
def checkout_configs(path: Path) -> Iterator[None]:
    """detrex's `get_config(name)` reads `detrex/config/configs/<name>`: a link to the checkout's top-level `configs/`
    that detrex's setup.py makes at install. A clone used as cloned has no link. While a LazyConfig inside a detrex
    checkout loads, a name missing there is read from the checkout's own `configs/`; where the link exists, and for
    every other config, nothing changes."""
    checkout = next((p / "configs" for p in path.resolve().parents if (p / "detrex" / "config").is_dir()), None)
    if checkout is None or not checkout.is_dir():
        yield
        return
    import detrex.config  # the config file imports it as it loads: importing it first changes nothing
    from detectron2.config import LazyConfig

    package = Path(detrex.config.__file__).resolve().parent
    original = detrex.config.get_config

    def get_config(config_path):
        if (package / "configs" / config_path).exists() or not (checkout / config_path).is_file():
            return original(config_path)
        return LazyConfig.load(str(checkout / config_path))

    holders = [m for name, m in list(sys.modules.items()) if name.startswith("detrex.config")
               and getattr(m, "get_config", None) is original]
    with contextlib.ExitStack() as stack:
        for module in holders:
            stack.enter_context(mock.patch.object(module, "get_config", get_config))
        yield


def build(d2cfg: Any):
    from detectron2.config import instantiate

    try:
        return instantiate(d2cfg.model)
    except Exception as e:  # noqa: BLE001 - building runs the user's constructors
        raise LazyConfigError(f"instantiating the LazyConfig's model failed: {type(e).__name__}: {e}") from e


def _target_name(node: Any) -> str:
    target = node.get("_target_", "") if hasattr(node, "get") else ""
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _test_mapper(d2cfg: Any) -> Any:
    try:
        return d2cfg.dataloader.test.mapper
    except Exception:  # noqa: BLE001 - no dataloader section: the defaults below apply
        return {}


def test_resize(d2cfg: Any) -> tuple[int, int]:
    """(shortest edge, longest-edge cap) of the ResizeShortestEdge among the test mapper's augmentations; (0, 0)
    (no resize) when there is none."""
    for aug in _test_mapper(d2cfg).get("augmentation", None) or []:
        if _target_name(aug) == "ResizeShortestEdge":
            short = aug.get("short_edge_length")
            short = short[-1] if isinstance(short, Sequence) else short  # a test-time choice list holds one size
            return int(short), int(aug.get("max_size", 0) or 0)
    return 0, 0


def preprocess(d2cfg: Any) -> dict[str, Any]:
    """The manifest's pre-processing from a LazyConfig (the yacs keys' meaning, read from where detrex puts them)."""
    model = d2cfg.model
    if "pixel_mean" not in model or "pixel_std" not in model:
        raise LazyConfigError("the LazyConfig's model has no pixel_mean/pixel_std: cannot say how to normalise")
    short, longest = test_resize(d2cfg)
    return {"input_format": str(_test_mapper(d2cfg).get("img_format", "RGB")), "min_size_test": short,
            "max_size_test": longest, "pixel_mean": [float(v) for v in model.pixel_mean],
            "pixel_std": [float(v) for v in model.pixel_std]}


def class_names(d2cfg: Any) -> list[str] | None:
    """thing_classes of the test dataset's metadata, where detectron2 knows the dataset; else None."""
    try:
        names = d2cfg.dataloader.test.dataset.names
    except Exception:  # noqa: BLE001 - no test dataset named
        return None
    from detectron2.data import MetadataCatalog  # importing detectron2.data registers the builtin datasets

    first = names if isinstance(names, str) else names[0]
    classes = MetadataCatalog.get(first).get("thing_classes", None)
    return list(classes) if classes else None
