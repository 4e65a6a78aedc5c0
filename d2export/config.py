"""Hydra structured configs: the schema every `configs/*.yaml` is checked against (a typo is an error, not a no-op)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import MISSING

from d2export import DEFAULT_COMPILED_OPS
from d2export.ops import SAMPLERS

EXPORTERS = ("torchscript", "dynamo")
FUSED_PRECISIONS = ("float32", "float16")  # export.fp16_fused
TARGETS = ("onnxruntime", "tensorrt")
# where a model is built and run: export.device, and train_spotter --device
DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?")
OPSETS = {"onnxruntime": (11, 21), "tensorrt": (16, 19)}  # TensorRT mishandles GridSample 'linear' at >= 20


def opt(default: Any = MISSING, help: str = "", *, factory: Any = None) -> Any:
    """A schema field with its one-line meaning (`help`): docs/config.md and `d2export export --help` read it."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    sys_path: List[str] = opt(factory=list, help="folders put on sys.path before importing (relative to the "
                              "working directory)")
    imports: List[str] = opt(factory=list, help="modules imported so their detectron2 registries fill, e.g. "
                             "[adet.modeling]")
    cfg_factory: str = opt("detectron2.config:get_cfg", "'module:function' returning a detectron2 CfgNode with the "
                           "project's keys added")
    cfg_adders: List[str] = opt(factory=list, help="'module:function's called on that CfgNode before the YAML is "
                                "merged, each adding a project's keys, e.g. [mask2former:add_maskformer2_config]")
    d2_config: Optional[str] = opt(None, "the project's detectron2 YAML (yacs); this or model.lazy_config")
    opts: List[str] = opt(factory=list, help="detectron2 overrides: [KEY, VALUE, …]")
    lazy_config: Optional[str] = opt(None, "a LazyConfig .py (detrex's `model = L(DeformableDETR)(...)`) instead of "
                                     "model.d2_config")
    lazy_overrides: List[str] = opt(factory=list, help="LazyConfig overrides: [\"key=value\", …]")
    weights: Optional[str] = opt(None, "checkpoint (.pth/.pkl); null exports seeded random weights (said loudly)")
    strict_weights: bool = opt(True, "every parameter and buffer must come from model.weights with the model's shape; "
                               "false: export anyway, the missing/unexpected/mismatched names in the manifest")
    seed: int = opt(0, "seed for random weights and dummy inputs")
    family: str = opt("auto", "model family reading the outputs (d2export/families); auto tries each in turn")
    charset: Optional[str] = opt(None, "a text spotter's character dictionary (pickled list, JSON list or map, or "
                                 "text, one per line) instead of the one its config names (MODEL.TRANSFORMER."
                                 "CUSTOM_DICT, MODEL.BATEXT.CUSTOM_DICT) or the built-in one for its VOC_SIZE")


@dataclass
class PluginConfig:
    compiled_ops: List[str] = opt(factory=lambda: list(DEFAULT_COMPILED_OPS),
                                  help="compiled MSDA extension modules to stand in for when missing or CPU-less")
    import_only: List[str] = opt(factory=list, help="modules the model's code imports but never runs (detectron2._C "
                                 "for Mask2Former's evaluator, natten, wandb): stood in for when missing; anything "
                                 "imported from them says so when used")
    swap_msda: bool = opt(True, "point every MSDA module at d2export's traceable core")


@dataclass
class ExportConfig:
    output_dir: str = opt("outputs/${name}", "where model.onnx and its manifest are written")
    filename: str = opt("model.onnx", "the graph's file name (the manifest is <stem>.manifest.json)")
    device: str = opt("auto", "where the model is built and traced and its eager references computed: auto (cuda "
                      "where torch sees a GPU) | cpu | cuda | cuda:N. The graph is the same either way; on CUDA, "
                      "TF32 is off while references are computed (it would swap near-tied proposals)")
    exporter: str = opt("torchscript", "torchscript | dynamo (torch.export-based) | auto (TorchScript, then "
                        "torch.export where it fails; the manifest names the route that wrote the graph)")
    target: str = opt("onnxruntime", "onnxruntime | tensorrt: the runtime the graph is shaped for (patches, opsets)")
    opset: Optional[int] = opt(None, "ONNX opset; null: 17 (onnxruntime 11–21, tensorrt 16–19)")
    sampler: str = opt("gather", "MSDA sampler in the graph: gather (portable, the default) | grid_sample (GridSample "
                       "nodes, opset >= 16) | pytorch | trt_plugin (TensorRT's plugin node) | fused (d2export's CPU "
                       "operator for onnxruntime: fastest; runs where d2export's native library was built, or with the "
                       "`fused` extra) | auto (gather when "
                       "exporting)")
    dynamic: bool = opt(True, "dynamic batch, height and width; false bakes the dummy's shape")
    simplify: bool = opt(False, "run onnxslim over the graph after export")
    dummy_sizes: List[List[int]] = opt(factory=lambda: [[320, 320]], help="[height, width] per dummy image traced "
                                       "(several: a batch)")
    text_logits: bool = opt(False, "text spotters: also output the raw recognition logits [N, K, 25, voc+1]")
    postprocess: str = opt("outside", "segmenters (Mask2Former, OneFormer, MaskDINO): outside (serving computes the "
                           "results from the head's outputs) | graph (also the masks upsampled and each task's "
                           "per-pixel work in the graph: semantic map, panoptic competition, instance top-k and masks)")
    lint: bool = opt(True, "check the graph for the dummy's size: TorchScript traced again at a second size, "
                           "constants that follow it flagged; torch.export: what its capture assumed of the sizes "
                           "(minimums, conditions), read off it; false skips TorchScript's second trace only (the "
                           "capture's reading costs nothing and the check below its minimums needs it)")
    fp16: bool = opt(False, "write a float16 graph (MSDA sampling, Softmax, Range … stay float32); verified with "
                     "verify.fp16_atol and top-K agreement")
    keep_io_types: bool = opt(True, "with fp16: the graph's float inputs and outputs stay float32 (false: "
                                "float16, except outputs of nodes kept in float32)")
    fp16_fused: str = opt("float32", "with fp16 and sampler=fused: the fused MSDA node's value and output precision, "
                          "float32 (kept, as the sampling cores) | float16 (read as float16, summed in float32; its "
                          "locations and weights stay float32; the native kernels only, not numba); verified as the "
                          "rest of the float16 graph")
    int8: str = opt("", "write an int8 graph with onnxruntime's quantization: dynamic (MatMul/Gemm weights, "
                    "activations per run) | static (activations calibrated on export.calibration; the family's "
                    "operator types); what int8 breaks stays float (docs/precision.md); verified with verify.int8_*")
    int8_recipe: str = opt("family", "what int8 keeps float: family (the family's float scopes: what int8's tensor "
                           "verification holds) | heads (the decoding heads and MSDA's sampling only, convolutions "
                           "quantised too: faster, its tensors move past int8's tolerances, so it is held to accuracy "
                           "and needs verify.int8_accuracy)")
    int8_weight_bits: int = opt(0, "with int8: 7 or 8 bits of weights; 0: by this CPU (8 with VNNI or AMX, else 7). "
                                "8-bit weights are finer; served on a CPU without VNNI, onnxruntime computes them "
                                "exactly but slower, and OpenVINO refuses them there (its products would saturate)")
    int8_rounding: str = opt("nearest", "with static int8: how weights are rounded to their steps: nearest | gptq "
                             "(GPTQ: each product's rounding error carried onto the rows not yet rounded, weighted by "
                             "the calibration pictures' activations; the scales unchanged, so it serves at the same "
                             "speed; docs/precision.md has what it paid)")
    int8_keep_float: List[str] = opt(factory=list, help="with int8: modules whose convolutions and MatMuls stay float "
                                     "besides the recipe's, by name as in the graph's node paths (backbone, "
                                     "input_proj, linear1 …); a name that matches no such node is refused")
    bf16: bool = opt(False, "serve the float32 graph in bfloat16 through OpenVINO (manifest precision bfloat16, "
                     "runtime openvino), on CPUs with AVX512-BF16 or AMX-BF16; verified as served with verify.bf16_*; "
                     "export.sampler fused (d2export's OpenVINO extension, built on first use), gather or "
                     "grid_sample")
    runtime: str = opt("", "what serves the graph: onnxruntime | openvino; empty: the precision's own (OpenVINO for "
                       "bf16, onnxruntime for the rest). openvino also serves int8 graphs (their quantised "
                       "convolutions and MatMuls in int8, the float rest in float32; faster than onnxruntime's int8 "
                       "where measured, docs/precision.md); verified as served")
    calibration: str = opt("", "int8=static: the calibration pictures, a folder (`d2export synth` writes one) or a "
                           "registered detectron2 dataset")
    calibration_count: int = opt(32, "int8=static: how many of those pictures, the first in name order")
    calibration_method: str = opt("minmax", "int8=static: minmax | entropy | percentile (one picture at a time "
                                  "through the calibrator: memory stays that of one run)")
    max_pixels: int = opt(4096 * 4096, "largest height×width any size in this config may have")


@dataclass
class VerifyConfig:
    enabled: bool = opt(True, "compare onnxruntime with eager PyTorch before writing anything")
    sizes: List[List[int]] = opt(factory=list, help="[height, width] checked one by one; empty: the dummy size, its "
                                 "transpose, a non-square pair and an odd size (rounded up to the least multiple "
                                 "of 8..128 the model's own code runs at, where it refuses them)")
    batch: bool = opt(True, "also a batch of two images of different sizes")
    pictures: str = opt("", "the cases' pictures: a folder (`d2export synth` writes one) or a registered dataset, "
                        "one picture a case, each stretched to the case's size; empty: synthetic pictures (bars, "
                        "strokes, noise). A reduced-precision reader is judged on text it reads, not strokes it "
                        "guesses at")
    atol: float = opt(1e-3, "absolute tolerance (float32 graph) of probabilities, logits and masks")
    rtol: float = opt(1e-3, "relative tolerance (float32 graph), every kind but ids")
    pixel_atol: float = opt(1e-3, "absolute tolerance (float32 graph) of coordinates in input pixels: boxes, control "
                            "and boundary points, keypoints; ids (labels, characters) must match")
    max_mismatch: float = opt(1e-3, "fraction of integer (argmax) outputs allowed to flip on near-ties")
    fp16_atol: float = opt(5e-2, "absolute tolerance for a float16 graph (export.fp16)")
    fp16_rtol: float = opt(5e-2, "relative tolerance for a float16 graph")
    fp16_pixel_atol: float = opt(1.0, "float16: absolute tolerance of coordinates, in input pixels")
    fp16_pixel_rtol: float = opt(2e-3, "float16: relative tolerance of coordinates (0.002: 1.3 px more at x = 640)")
    fp16_max_mismatch: float = opt(0.05, "float16: fraction of elements allowed outside the tolerance, in detections "
                                   "that are not confident (and ids that may tie in those that are)")
    confident: float = opt(0.3, "reduced precision: a detection scoring at least this on either side must agree on "
                           "every output (ids equal unless their probability allows a tie); under every family's "
                           "display threshold (text 0.35-0.5, DETR 0.5)")
    int8_atol: float = opt(0.05, "absolute tolerance for an int8 graph (export.int8): scores, probabilities, logits")
    int8_rtol: float = opt(0.05, "int8: relative tolerance of scores, probabilities and logits")
    int8_pixel_atol: float = opt(3.0, "int8: absolute tolerance of coordinates, in input pixels")
    int8_pixel_rtol: float = opt(5e-3, "int8: relative tolerance of coordinates")
    int8_max_mismatch: float = opt(0.1, "int8: fraction of elements allowed outside the tolerance, in detections that "
                                   "are not confident (and ids that may tie in those that are)")
    int8_accuracy: str = opt("", "labelled held-out pictures (a folder `d2export synth` wrote, or a registered "
                             "dataset; never the calibration pictures) that judge an int8 graph by what it serves: "
                             "the family's evaluator scores the float32 and the int8 graph through the runtime, and "
                             "each headline metric (H-mean, AP, mIoU, PQ) may drop at most verify.int8_max_drop; the "
                             "tensor comparison (verify.int8_*) is then recorded, not gating. Empty: tensors gate")
    int8_max_drop: float = opt(1.0, "verify.int8_accuracy: points a headline metric may lose against the float32 "
                               "graph's on the same pictures")
    bf16_atol: float = opt(0.05, "absolute tolerance for a graph served in bfloat16 (export.bf16): scores, "
                           "probabilities, logits")
    bf16_rtol: float = opt(0.05, "bfloat16: relative tolerance of scores, probabilities and logits")
    bf16_pixel_atol: float = opt(3.0, "bfloat16: absolute tolerance of coordinates, in input pixels")
    bf16_pixel_rtol: float = opt(5e-3, "bfloat16: relative tolerance of coordinates")
    bf16_max_mismatch: float = opt(0.1, "bfloat16: fraction of elements allowed outside the tolerance, in detections "
                                   "that are not confident (and ids that may tie in those that are)")
    bf16_accuracy: str = opt("", "labelled held-out pictures that judge a bfloat16 graph by what it serves, as "
                             "verify.int8_accuracy judges int8: the float32 graph (onnxruntime) and the bfloat16 graph "
                             "(OpenVINO) scored by the family's evaluator, each headline metric dropping at most "
                             "verify.bf16_max_drop; the tensor comparison (verify.bf16_*) is then recorded, not "
                             "gating. Empty: tensors gate")
    bf16_max_drop: float = opt(1.0, "verify.bf16_accuracy: points a headline metric may lose against the float32 "
                               "graph's on the same pictures")
    top_k: int = opt(5, "float16, int8 and bfloat16: the top-K scoring detections must be the same ones")
    min_top_k_agreement: float = opt(0.8, "float16: least fraction of the eager top-K found in the graph's top-K")
    providers: List[str] = opt(factory=lambda: ["CPUExecutionProvider"], help="onnxruntime providers for "
                               "verification (cpu, cuda, tensorrt or onnxruntime's names): verify on the one you "
                               "serve with; cuda runs with the options `infer`/`serve` give the graph's "
                               "precision (TF32 off for float32)")
    pin_selections: bool = opt(True, "a failed case passes if the graph picked differently (TopK, NMS) only as far "
                               "as its own candidate values' difference from eager's (within the outputs' "
                               "tolerances) explains, and every output agrees with that pick imposed on eager")
    ladder: bool = opt(False, "run the parity ladder (docs/ladder.md) always, not only when verification fails")


@dataclass
class D2ExportConfig:
    name: str = opt("model", "the job's name (output folders are named after it)")
    model: ModelConfig = opt(factory=ModelConfig, help="what to build")
    plugin: PluginConfig = opt(factory=PluginConfig, help="compiled-op stand-ins and the MSDA swap")
    export: ExportConfig = opt(factory=ExportConfig, help="how the graph is made")
    verify: VerifyConfig = opt(factory=VerifyConfig, help="how it is checked against PyTorch")
    traceback: bool = opt(False, "full Python tracebacks instead of one-line errors")


def schema_rows(node: type = D2ExportConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for every leaf key of the schema, in declaration order: the config reference
    (scripts/config_doc.py → docs/config.md) and `d2export export --help` are made from these."""
    import dataclasses

    rows = []
    for f in dataclasses.fields(node):
        key = prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += schema_rows(type(default), key + ".")
            continue
        shown = "(required)" if default == MISSING else "null" if default is None else str(default).replace("'", "")
        rows.append((key, str(f.type), shown.lower() if isinstance(default, bool) else shown, f.metadata["help"]))
    return rows


def groups() -> list[tuple[str, str]]:
    """(group, meaning) of the schema's top-level sections."""
    import dataclasses

    return [(f.name, f.metadata["help"]) for f in dataclasses.fields(D2ExportConfig)
            if f.default_factory is not dataclasses.MISSING]


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="d2export_schema", node=D2ExportConfig)


class UserError(RuntimeError):
    """A problem with the user's input (config, files, code): reported in one line, without a traceback."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work: said in one line, before anything is built."""


def default_opset(target: str) -> int:
    return 17


def resolve(cfg: Any) -> D2ExportConfig:
    """A Hydra/OmegaConf config → the typed dataclass, with every value a schema cannot check checked (torch-free,
    fast: it runs before any model is built)."""
    from omegaconf import OmegaConf

    obj: D2ExportConfig = OmegaConf.to_object(cfg) if not isinstance(cfg, D2ExportConfig) else cfg
    m, e, v = obj.model, obj.export, obj.verify
    if (m.d2_config is None) == (m.lazy_config is None):
        raise ConfigError("give exactly one of model.d2_config (a yacs YAML) and model.lazy_config (a LazyConfig .py)"
                          f", got {'both' if m.d2_config else 'neither'}")
    _one_of("export.exporter", e.exporter, EXPORTERS + ("auto",))
    _one_of("export.target", e.target, TARGETS)
    _one_of("export.sampler", e.sampler, SAMPLERS)
    _one_of("export.postprocess", e.postprocess, ("outside", "graph"))
    if not DEVICE_NAMES.fullmatch(e.device):
        raise ConfigError(f"export.device={e.device!r}: choose auto, cpu, cuda or cuda:N")
    if e.opset is None:
        e.opset = default_opset(e.target)
    if e.sampler == "fused" and e.target != "onnxruntime":
        raise ConfigError("export.sampler=fused is an onnxruntime operator: use export.target=onnxruntime "
                          "(for TensorRT: export.sampler=trt_plugin)")
    lo, hi = OPSETS[e.target]
    if not lo <= e.opset <= hi:
        raise ConfigError(f"export.opset={e.opset}: {e.target} takes {lo}–{hi}")
    if e.int8 not in ("", "dynamic", "static"):
        raise ConfigError(f"export.int8={e.int8!r}: choose dynamic or static (or leave it empty for float)")
    if sum(map(bool, (e.int8, e.fp16, e.bf16))) > 1:
        raise ConfigError("export." + " and export.".join(k for k in ("fp16", "int8", "bf16") if getattr(e, k))
                          + " both set: a graph has one precision")
    _runtime_chosen(e, v.enabled)
    if e.bf16:
        _bf16_servable(e, v.enabled)
    elif v.bf16_accuracy:
        raise ConfigError("verify.bf16_accuracy judges a bfloat16 graph: set export.bf16=true")
    _one_of("export.fp16_fused", e.fp16_fused, FUSED_PRECISIONS)
    _int8_judged(e, v)
    if e.int8 == "static" and not e.calibration:
        raise ConfigError("export.int8=static needs export.calibration: a folder of pictures (`d2export synth text "
                          "--out DIR`) or a registered dataset")
    if e.calibration_method not in ("minmax", "entropy", "percentile") or e.calibration_count < 1:
        raise ConfigError(f"export.calibration_method={e.calibration_method!r}, calibration_count="
                          f"{e.calibration_count}: minmax, entropy or percentile, on at least one picture")
    if e.max_pixels <= 0:
        raise ConfigError(f"export.max_pixels={e.max_pixels}: must be positive")
    if not e.dummy_sizes:
        raise ConfigError("export.dummy_sizes is empty: give at least one [height, width]")
    _sizes("export.dummy_sizes", e.dummy_sizes, e.max_pixels)
    _sizes("verify.sizes", v.sizes, e.max_pixels)
    for key in ("atol", "rtol", "max_mismatch", "fp16_atol", "fp16_rtol", "fp16_pixel_atol", "fp16_pixel_rtol",
                "fp16_max_mismatch", "int8_atol", "int8_rtol", "int8_pixel_atol", "int8_pixel_rtol",
                "int8_max_mismatch", "bf16_atol", "bf16_rtol", "bf16_pixel_atol", "bf16_pixel_rtol",
                "bf16_max_mismatch", "confident", "int8_max_drop", "bf16_max_drop"):
        if not getattr(v, key) >= 0:
            raise ConfigError(f"verify.{key}={getattr(v, key)}: must be 0 or more")
    if v.top_k < 1 or not 0 <= v.min_top_k_agreement <= 1:
        raise ConfigError(f"verify.top_k={v.top_k}, verify.min_top_k_agreement={v.min_top_k_agreement}: "
                          "need top_k >= 1 and an agreement in [0, 1]")
    from d2export import families  # torch-free: family modules are part of the serving runtime

    _one_of("model.family", obj.model.family, families.requestable())
    return obj


def _int8_judged(e: ExportConfig, v: VerifyConfig) -> None:
    """What int8 keeps float and what judges it, said up front: the heads recipe needs labelled pictures (its
    tensors move past int8's tolerances by design), and the pictures that judge accuracy are not those it was
    calibrated on."""
    _one_of("export.int8_recipe", e.int8_recipe, ("family", "heads"))
    if e.int8_weight_bits not in (0, 7, 8):
        raise ConfigError(f"export.int8_weight_bits={e.int8_weight_bits}: choose 7, 8 or 0 (by this CPU)")
    _one_of("export.int8_rounding", e.int8_rounding, ("nearest", "gptq"))
    if e.int8_rounding == "gptq" and e.int8 != "static":
        raise ConfigError("export.int8_rounding=gptq rounds against calibrated activations: set export.int8=static")
    if e.int8_keep_float and not e.int8:
        raise ConfigError("export.int8_keep_float names what int8 keeps float: set export.int8 (dynamic or static)")
    if v.int8_accuracy and not e.int8:
        raise ConfigError("verify.int8_accuracy judges an int8 graph: set export.int8 (dynamic or static)")
    if e.int8 and e.int8_recipe == "heads" and v.enabled and not v.int8_accuracy:
        raise ConfigError("export.int8_recipe=heads moves tensors past int8's tolerances and is held to accuracy "
                          "instead: give verify.int8_accuracy=FOLDER (labelled held-out pictures, `d2export synth "
                          "text --out FOLDER` makes some), or use export.int8_recipe=family")
    if v.int8_accuracy and e.calibration and _same_place(v.int8_accuracy, e.calibration):
        raise ConfigError(f"verify.int8_accuracy={v.int8_accuracy} is export.calibration: the pictures int8 was "
                          "calibrated on cannot judge it; give held-out pictures")


def _same_place(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()


def _runtime_chosen(e: ExportConfig, verifying: bool) -> None:
    """export.runtime: OpenVINO serves bfloat16 and, when asked, int8; onnxruntime the rest (float32 through OpenVINO
    measured 1.04-1.07x onnxruntime's: not worth a second float32 path). Each refusal in one line."""
    _one_of("export.runtime", e.runtime, ("", "onnxruntime", "openvino"))
    if e.bf16 and e.runtime == "onnxruntime":
        raise ConfigError("export.bf16 with export.runtime=onnxruntime: onnxruntime's CPU provider has no bfloat16 "
                          "GEMM, OpenVINO serves bfloat16; leave export.runtime empty")
    if e.runtime != "openvino" or e.bf16:
        return
    if not e.int8:
        raise ConfigError("export.runtime=openvino serves int8 and bfloat16 graphs (export.int8, export.bf16); "
                          f"a {'float16' if e.fp16 else 'float32'} graph is served by onnxruntime: leave "
                          "export.runtime empty")
    _openvino_loads(e, "export.runtime=openvino", verifying)


def _openvino_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def _openvino_loads(e: ExportConfig, what: str, verifying: bool) -> None:
    """A graph OpenVINO loads: written for onnxruntime, no TensorRT operator (the fused one through d2export's
    extension); verified as OpenVINO serves it, so OpenVINO is installed, said before anything is built."""
    if e.target != "onnxruntime":
        raise ConfigError(f"{what} with export.target={e.target}: OpenVINO serves on the CPU; use "
                          "export.target=onnxruntime (for TensorRT: export.fp16=true)")
    if e.sampler not in ("fused", "gather", "grid_sample", "pytorch", "auto"):
        raise ConfigError(f"{what} with export.sampler={e.sampler}: OpenVINO cannot load that operator; use "
                          "export.sampler=fused (or gather, grid_sample)")
    if verifying and not _openvino_installed():
        raise ConfigError(f"{what} is verified as OpenVINO serves it and needs the openvino package: pip install "
                          "'d2export[openvino]' (or verify.enabled=false, to serve it where OpenVINO is)")


def _bf16_servable(e: ExportConfig, verifying: bool) -> None:
    """export.bf16: a graph OpenVINO loads, verified as served on a CPU with bfloat16 instructions; each refusal in
    one line."""
    _openvino_loads(e, "export.bf16", verifying)
    if verifying:  # verification serves the graph in bfloat16 here
        from d2export.runtime.openvino_session import Bf16Unavailable, require_bf16

        try:
            require_bf16(what="export.bf16 (verified as served in bfloat16)",
                         instead="export on such a CPU, or leave export.bf16 off (float32, or export.int8=dynamic)")
        except Bf16Unavailable as refusal:
            raise ConfigError(str(refusal)) from None


def check_files(cfg: D2ExportConfig, root: Path) -> None:
    """The files the config names exist (relative to `root`): said before importing or building anything."""
    m = cfg.model
    named = [(f"model.{k}", getattr(m, k)) for k in ("d2_config", "lazy_config", "weights", "charset")
             if getattr(m, k)]
    named += [(f"model.sys_path[{i}]", p) for i, p in enumerate(m.sys_path)]
    for key, value in named:
        zoo = key == "model.d2_config"
        if key == "model.lazy_config" and lazy_config_path(root, value).exists():
            continue
        if not (root / value).exists() and not (zoo and in_model_zoo(value)):
            raise ConfigError(f"{key}={value}: no such file or folder (relative paths start at {root})"
                              + (", nor a config in detectron2's model zoo" if zoo else ""))


def lazy_config_path(root: Path, value: str) -> Path:
    """`model.lazy_config` as given, or, where that file is missing, the one file of that name in the nearest folder
    above it that exists: releases move configs between folders (detrex's DINO went from projects/dino/configs/ to
    projects/dino/configs/dino-resnet/), and a path written for one release should find it in another."""
    path = root / value
    if path.exists():
        return path
    above = next(p for p in path.parents if p.is_dir())
    found = sorted(above.rglob(path.name)) if above not in (root, root.resolve()) else []
    return found[0] if len(found) == 1 else path


def in_model_zoo(name: str) -> bool:
    """`name` is a config inside the installed detectron2's model zoo (e.g. COCO-Detection/retinanet_R_50_FPN_1x.yaml),
    found without importing detectron2."""
    import importlib.util

    spec = importlib.util.find_spec("detectron2")
    places = spec.submodule_search_locations or [] if spec else []
    return any((Path(p) / "model_zoo" / "configs" / name).is_file() for p in places)


def _one_of(key: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        import difflib

        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(allowed)}{hint}")


def _sizes(key: str, sizes: Sequence[Sequence[int]], max_pixels: int) -> None:
    for s in sizes:
        if len(s) != 2 or min(s) <= 0:
            raise ConfigError(f"{key}: {list(s)} is not a [height, width] of positive sides")
        if s[0] * s[1] > max_pixels:
            raise ConfigError(f"{key}: {s[0]}x{s[1]} has {s[0] * s[1]:,} pixels, over export.max_pixels="
                              f"{max_pixels:,}")


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
