"""Hydra structured configs: the schema every `configs/*.yaml` is checked against (a typo is an error, not a no-op)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from d2export import DEFAULT_COMPILED_OPS


@dataclass
class ModelConfig:
    # directories put on sys.path before importing (relative paths are taken from the repository/config root)
    sys_path: List[str] = field(default_factory=list)
    # modules imported so their detectron2 registries fill, e.g. ["adet.modeling"] or ["testr"]
    imports: List[str] = field(default_factory=list)
    # "module:function" returning a detectron2 CfgNode with the project's keys added
    cfg_factory: str = "detectron2.config:get_cfg"
    d2_config: Optional[str] = None  # the project's detectron2 YAML (yacs) …
    opts: List[str] = field(default_factory=list)  # detectron2 overrides: ["KEY", "VALUE", …]
    # … or a LazyConfig python file (detrex's `model = L(DeformableDETR)(...)`) and its "key=value" overrides
    lazy_config: Optional[str] = None
    lazy_overrides: List[str] = field(default_factory=list)
    weights: Optional[str] = None  # None: seeded random weights (said loudly)
    # every parameter and buffer must come from `weights`, each with the model's shape; false: export anyway, the
    # missing/unexpected/mismatched names listed in the manifest
    strict_weights: bool = True
    seed: int = 0
    # the model family (d2export/families: testr, rcnn, …); "auto" tries each in turn on the built model
    family: str = "auto"


@dataclass
class PluginConfig:
    # compiled MSDA extensions to stand in for when missing or CPU-less
    compiled_ops: List[str] = field(default_factory=lambda: list(DEFAULT_COMPILED_OPS))
    swap_msda: bool = True


@dataclass
class ExportConfig:
    output_dir: str = "outputs/${name}"
    filename: str = "model.onnx"
    exporter: str = "torchscript"  # or "dynamo" (torch.export-based)
    target: str = "onnxruntime"  # or "tensorrt"
    opset: Optional[int] = None  # None: 17 for onnxruntime, 17 for tensorrt (16–19 allowed)
    # MSDA sampler in the graph: gather (portable, the default) | grid_sample | pytorch | trt_plugin (TensorRT's
    # plugin node) | fused (d2export's CPU operator for onnxruntime: fastest, needs the `fused` extra where it runs)
    sampler: str = "gather"
    dynamic: bool = True  # dynamic batch, height and width
    simplify: bool = False  # onnxslim after export
    dummy_sizes: List[List[int]] = field(default_factory=lambda: [[320, 320]])  # one image per entry: a batch
    text_logits: bool = False  # also output the raw recognition logits [N, K, 25, voc+1]
    lint: bool = True  # trace at a second size and flag constants that follow the dummy's size


@dataclass
class VerifyConfig:
    enabled: bool = True
    # image sizes checked one by one; empty: the dummy size, its transpose and two others
    sizes: List[List[int]] = field(default_factory=list)
    batch: bool = True  # also a batch of two images of different sizes
    atol: float = 1e-3
    rtol: float = 1e-3
    max_mismatch: float = 1e-3  # fraction of integer (argmax) outputs allowed to flip on near-ties
    providers: List[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    # the parity ladder: compare every module's output, eager vs onnxruntime, and name the first that diverges
    # (runs on a failed verification, before the error; with true, always)
    ladder: bool = False


@dataclass
class D2ExportConfig:
    name: str = "model"
    model: ModelConfig = field(default_factory=ModelConfig)
    plugin: PluginConfig = field(default_factory=PluginConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    traceback: bool = False  # full Python tracebacks instead of one-line errors


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="d2export_schema", node=D2ExportConfig)


def default_opset(target: str) -> int:
    return 17


def resolve(cfg: Any) -> D2ExportConfig:
    """A Hydra/OmegaConf config → the typed dataclass, checking the values a schema cannot."""
    from omegaconf import OmegaConf

    obj: D2ExportConfig = OmegaConf.to_object(cfg) if not isinstance(cfg, D2ExportConfig) else cfg
    m, e = obj.model, obj.export
    if (m.d2_config is None) == (m.lazy_config is None):
        raise ValueError("give exactly one of model.d2_config (a yacs YAML) and model.lazy_config (a LazyConfig .py)"
                         f", got {'both' if m.d2_config else 'neither'}")
    if e.exporter not in ("torchscript", "dynamo"):
        raise ValueError(f"export.exporter={e.exporter!r}: choose torchscript or dynamo")
    if e.target not in ("onnxruntime", "tensorrt"):
        raise ValueError(f"export.target={e.target!r}: choose onnxruntime or tensorrt")
    if e.opset is None:
        e.opset = default_opset(e.target)
    if e.sampler == "fused" and (e.exporter != "torchscript" or e.target != "onnxruntime"):
        raise ValueError("export.sampler=fused is an onnxruntime operator exported by the torchscript exporter: "
                         "use export.target=onnxruntime export.exporter=torchscript (for TensorRT: trt_plugin)")
    if e.target == "tensorrt" and not 16 <= e.opset <= 19:
        raise ValueError(f"export.opset={e.opset} for tensorrt: use 16–19 (GridSample 'linear' at ≥20 is mishandled)")
    if not e.dummy_sizes or any(len(s) != 2 or min(s) <= 0 for s in e.dummy_sizes):
        raise ValueError(f"export.dummy_sizes={e.dummy_sizes}: give a list of [height, width]")
    return obj


REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def find_config(name: str) -> Path:
    """A bare name is looked up in ./configs, then in the repository's configs/; a path is taken as it is."""
    p = Path(name)
    candidates = [p] if p.suffix in (".yaml", ".yml") else [p.with_suffix(".yaml"), p]
    if not p.is_absolute() and len(p.parts) == 1:
        candidates += [Path("configs") / c for c in candidates] + [REPO_CONFIGS / c for c in candidates]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    known = ", ".join(sorted(f.stem for f in REPO_CONFIGS.glob("*.yaml")))
    raise FileNotFoundError(f"no config {name!r} (bare names are looked up in configs/: {known})")


def load(name: str, overrides: Sequence[str] = ()) -> D2ExportConfig:
    """Compose a config outside a Hydra run (tests, benchmarks, the runtime's tools): same files, same overrides.
    `${hydra:…}` interpolations are unavailable here, so give export.output_dir when the config uses one."""
    from hydra import compose, initialize_config_dir

    path = find_config(name)
    register_configs()
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        cfg = compose(config_name=path.stem, overrides=list(overrides))
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.pop("hydra", None)
    return resolve(cfg)
