"""Model families: how d2export recognises, adapts and reads each kind of model, one module per family.

A family module in this package (or an installed package's entry point in the `d2export.families` group) defines
`FAMILY`, an instance of a `Family` subclass. It says, as data plus a few small methods:
- how to recognise a built model by what it has (`missing`: None when the model is one, else what it lacks);
- how the tracing adapter runs it from `images` [N,3,H,W] uint8 + `image_sizes` [N,2] (`adapter`);
- the manifest's pre- and post-processing sections (`preprocess`, `postprocess`);
- the torch-free post-processing of graph outputs into `Instance`s at serving time (`instances`).
The pipeline, the runtime and the CLI look families up here and never branch on a family's name, so a new family is
one new module. Module top levels stay torch-free (the runtime imports them); torch is imported inside the export-side
methods.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from d2export.instances import Instance, Prediction

ENTRY_POINT_GROUP = "d2export.families"
AUTO = "auto"  # recognise: try every family in turn


class FamilyError(ValueError):
    """No family fits the model, or the one asked for does not: the message names each family and what it missed."""


@dataclass
class AdapterOptions:
    example: Sequence[np.ndarray] = field(default_factory=list)  # the export's dummy images (CHW uint8)
    text_logits: bool = False  # text spotters: also output the raw recognition logits
    postprocess: str = "outside"  # segmenters: "graph" puts each task's per-pixel work in the graph too


class Family:
    name: str = ""
    aliases: tuple[str, ...] = ()  # older names found in manifests
    summary: str = ""  # one line for help texts
    priority: int = 50  # `auto` tries families in ascending priority: specific ones before general ones
    # graph input/output name → what it holds, written into the manifest and the model
    input_docs: dict[str, str] = {
        "images": "uint8 pixels [N, 3, H, W] in the manifest's input_format, resized as preprocess says, zero-padded",
        "image_sizes": "int64 [N, 2]: each image's height and width before padding"}
    output_docs: dict[str, str] = {}
    postprocess_in_graph = False  # export.postprocess=graph is offered
    # graph output name → the kind of value it holds ("pixels", "probabilities", "logits", "ids", "masks"), which
    # picks its verification tolerance (verify.output_tolerances); an output not listed counts as logits
    output_kinds: dict[str, str] = {}
    # the output the detections are sorted by (descending), where they are: tied slots may swap in verification
    sorted_by: str | None = None
    # export.int8: modules (torch.onnx names nodes by module path) whose Conv/MatMul/Gemm stay float, where int8
    # breaks what a few bits move far: sampling locations, attention weights, box and point decoding (docs/int8.md)
    int8_float_scopes: tuple[str, ...] = ()
    # export.int8=static: the operator types quantised (dynamic takes MatMul and Gemm)
    int8_static_ops: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
    # export.int8_recipe=heads (int8 held to accuracy on labelled pictures, not to tensors): what stays float then,
    # the decoding heads and MSDA's sampling; static quantises Conv, MatMul and Gemm. None: int8_float_scopes
    int8_head_scopes: tuple[str, ...] | None = None
    # seeded random weights only (never a checkpoint): parameter-name fragment → factor, for heads whose random
    # initialisation is degenerate as no trained model is (every score saturated to 1.0, boxes thrown off the picture)
    seeded_scales: dict[str, float] = {}
    # seeded random weights only: standardise the outputs of normalisation layers with fixed statistics on the dummy
    # picture (building.condition_seeded), where random deep backbones blow activations (and float noise) up
    seeded_norms: bool = False
    # its predictions hold per-pixel maps (`Prediction.semantic`, `.panoptic`): batch jobs give them columns of their own
    pixel_maps: bool = False
    # `d2export evaluate`'s default metric: "coco" (COCOEvaluator: boxes, masks, keypoints) or "text" (d2export's
    # text spotting evaluator)
    evaluator: str = "coco"

    # export side (torch may be imported inside these) ------------------------------------------------------------
    def missing(self, model) -> str | None:
        """None when `model` (a built detectron2 model) belongs to this family; else a short phrase of what it lacks."""
        raise NotImplementedError

    def adapter(self, model, d2cfg, options: AdapterOptions):
        """The torch.nn.Module traced for export: named inputs → flat output tensors (see d2export/tracing)."""
        raise NotImplementedError

    def preprocess(self, d2cfg) -> dict[str, Any]:
        """The manifest's pre-processing: detectron2's test-time transform, from a yacs config or a LazyConfig."""
        from d2export import lazyconfig

        if lazyconfig.is_lazy(d2cfg):
            return lazyconfig.preprocess(d2cfg)
        return {"input_format": d2cfg.INPUT.FORMAT, "min_size_test": int(d2cfg.INPUT.MIN_SIZE_TEST),
                "max_size_test": int(d2cfg.INPUT.MAX_SIZE_TEST), "pixel_mean": list(d2cfg.MODEL.PIXEL_MEAN),
                "pixel_std": list(d2cfg.MODEL.PIXEL_STD)}

    def postprocess(self, d2cfg) -> dict[str, Any]:
        """The manifest's post-processing section: what `instances` needs (threshold, charset, class names, …)."""
        return {}

    def text_charset(self, d2cfg, override: str | None = None, search=(), model=None) -> dict[str, Any]:
        """The manifest's character set (`charset`, `charset_source`, `charset_sha256`) where the family reads text,
        from the model's own config or `override` (model.charset), else the table of the model's own code; {} where
        it reads none. Raises charset.CharsetError."""
        return {}

    # serving side (numpy only) ------------------------------------------------------------------------------------
    def instances(self, outputs: dict[str, np.ndarray], index: int, input_hw: tuple[int, int],
                  original_hw: tuple[int, int], post: dict[str, Any], threshold: float) -> list[Instance]:
        """Row `index` of a batch's outputs → instances in the original picture's pixels. `input_hw` is the size
        the picture had in the graph (after resizing), `original_hw` its size before."""
        raise NotImplementedError(f"family {self.name!r} has no serving-side post-processing")

    def prediction(self, outputs: dict[str, np.ndarray], index: int, input_hw: tuple[int, int],
                   original_hw: tuple[int, int], post: dict[str, Any], threshold: float) -> Prediction:
        """Row `index` of a batch's outputs → the picture's prediction: its `instances`, and pixel maps where the
        family makes them (segmentation)."""
        found = self.instances(outputs, index, input_hw, original_hw, post, threshold)
        return Prediction(int(original_hw[0]), int(original_hw[1]), found)

    def __repr__(self) -> str:
        return f"<family {self.name}>"


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, Family]:
    found: list[Family] = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found.extend(getattr(module, "FAMILIES", (module.FAMILY,)))
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.append(ep.load())
    return {f.name: f for f in sorted(found, key=lambda f: (f.priority, f.name))}


def families() -> list[Family]:
    """Every known family, in the order `auto` tries them."""
    return list(_registry().values())


def get(name: str) -> Family:
    """A family by its name (or an older alias), as the manifest records it."""
    for family in families():
        if name == family.name or name in family.aliases:
            return family
    raise FamilyError(f"unknown model family {name!r}; known: {', '.join(names())}")


def names() -> list[str]:
    return [f.name for f in families()]


def requestable() -> list[str]:
    """What `model.family` may say: "auto" (try each family in turn) or a family's name."""
    return [AUTO, *names()]


def recognise(model, requested: str = AUTO) -> Family:
    """The family of a built model: the one asked for (checked), or with "auto" the first that fits."""
    candidates = families() if requested == AUTO else [get(requested)]
    misses = []
    for family in candidates:
        lacks = family.missing(model)
        if lacks is None:
            return family
        misses.append(f"{family.name}: {lacks}")
    what = type(model).__name__
    if requested == AUTO:
        raise FamilyError(f"no model family fits {what}: " + "; ".join(misses))
    fits = next((f.name for f in families() if f.name != requested and f.missing(model) is None), None)
    hint = f"; family {fits!r} fits it: model.family={fits}" if fits else "; no other family fits it either"
    raise FamilyError(f"{what} is not a model of family {requested!r} ({misses[0]}){hint}")


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def find_child(model, attrs: Sequence[str], also_self: bool = False) -> tuple[str, Any]:
    """The first child module (or the model itself) that has every attribute in `attrs` ("a.b": attribute b of its
    attribute a): how a family finds a model's head by duck typing. Raises FamilyError naming the attributes the
    closest candidate lacks."""
    candidates = ([("", model)] if also_self else []) + list(model.named_children())
    best, best_missing = None, list(attrs)
    for name, module in candidates:
        lacking = [a for a in attrs if not _has(module, a)]
        if not lacking:
            return name, module
        if len(lacking) < len(best_missing):
            best, best_missing = name, lacking
    where = f"its child {best!r}" if best else "no child"
    raise FamilyError(f"needs a module with {', '.join(attrs)} ({where} lacks {', '.join(best_missing)})")


def lacks(model, attrs: Sequence[str], also_self: bool = False) -> str | None:
    """`find_child` as a `Family.missing` answer."""
    try:
        find_child(model, attrs, also_self)
        return None
    except FamilyError as e:
        return str(e)
