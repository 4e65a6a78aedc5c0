"""What the AdelaiDet-lineage text spotters (TESTR, DPText-DETR, DeepSolo) share: scores as their own `inference()`
computes them, points in input pixels, best character per slot — and, on the serving side, thresholding, rescaling to
the original picture and text decoding. Module top level stays torch-free (the runtime imports it).

Graph outputs (K = all queries; thresholding on the host):
- `scores` [N, K]: sigmoid of the mean control-point logit, max over classes; `labels` [N, K] its class;
- `ctrl_points` [N, K, P, 2]: control points (x, y) in input-image pixels;
- `char_ids` / `char_scores` [N, K, T]: best character per slot and its probability (id ≥ len(charset): none);
- `bd_points` [N, K, P, 4]: boundary points (upper x, y, lower x, y) in input pixels, where the model has them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from d2export.families import Family, find_child, lacks
from d2export.instances import Instance

OUTPUT_DOCS = {
    "scores": "instance confidence: sigmoid of the mean control-point logit, max over classes",
    "labels": "the class of that maximum",
    "ctrl_points": "control points (x, y) in input-image pixels",
    "bd_points": "boundary points (upper x, y, lower x, y) in input-image pixels",
    "char_ids": "best character per text slot (ids at or past the charset's length: no character)",
    "char_scores": "that character's probability",
    "languages": "the instance's script (index into the manifest's `languages`), whose head its characters are from",
}


OUTPUT_KINDS = {"scores": "probabilities", "labels": "ids", "ctrl_points": "pixels", "bd_points": "pixels",
                "char_ids": "ids", "char_scores": "probabilities", "text_logits": "logits", "languages": "ids"}


def own_visualizer(model, d2cfg, search=()) -> tuple[Any, str]:
    """The model's own `TextVisualizer` (`<package>.utils.visualizer`, the class its demo draws words with) made with
    its config, and its dotted name; or (None, why). It opens a relative dictionary path from where its tools run:
    the working directory, else each of `search`."""
    import importlib
    import os

    package = type(model).__module__.split(".")[0]
    try:
        module = importlib.import_module(f"{package}.utils.visualizer")
    except ImportError as e:
        return None, f"{package}.utils.visualizer cannot be imported ({e})"
    visualizer = getattr(module, "TextVisualizer", None)
    if visualizer is None:
        return None, f"{module.__name__} has no TextVisualizer"
    from detectron2.data import MetadataCatalog
    from detectron2.utils.visualizer import ColorMode

    name, error, before = f"{module.__name__}.TextVisualizer", None, os.getcwd()
    for folder in [None, *search]:
        try:
            if folder is not None:
                os.chdir(folder)
            return visualizer(np.zeros((8, 8, 3), np.uint8), MetadataCatalog.get("__unused"), ColorMode.IMAGE,
                              d2cfg), name
        except FileNotFoundError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - its own checks (a dictionary of the wrong length): said as they are
            return None, f"{name} could not be made: {type(e).__name__}: {e}"
        finally:
            os.chdir(before)
    return None, f"{name} could not open its dictionary: {error}"


def head_outputs(out) -> dict:
    """The head's outputs dict: DNTextSpotter's head returns (outputs, denoising record), the record training's only
    (None at inference); the others the dict alone."""
    return out[0] if isinstance(out, tuple) else out


def scores_labels(pred_logits):
    """[N, K, P, C] control-point logits → ([N, K] scores, [N, K] labels), as the models' inference() does."""
    return pred_logits.mean(-2).sigmoid().max(-1)


def to_pixels(points, image_sizes):
    """[N, K, P, 2·j] normalised (x, y, x, y, …) → input pixels, each image by its own size."""
    wh = image_sizes.flip(-1).to(points.dtype)
    wh = wh.repeat(1, points.shape[-1] // 2)[:, None, None, :]
    return points * wh


def best_chars(text_logits):
    """[N, K, T, V] logits → ([N, K, T] ids, [N, K, T] probabilities)."""
    probs, ids = text_logits.softmax(-1).max(-1)
    return ids, probs


def text_postprocess(transformer_cfg, points: str, reads: bool = False, ctc: bool = False,
                     num_chars: int | None = None) -> dict[str, Any]:
    """The manifest's post-processing for a text spotter: threshold, point layout and, where it `reads` text, how
    per-slot ids read (`ctc`: runs collapse, as DeepSolo's); the character set itself is `TextSpotter.text_charset`'s.
    `points`: "polygon" (closed outline), "bezier" (8 control points) or "centre_line" (open)."""
    t = transformer_cfg
    post = {"score_threshold": float(t.INFERENCE_TH_TEST), "points": points,
            "use_polygon": points != "bezier"}  # use_polygon: what manifests of the first release carry
    if reads:
        post |= {"voc_size": int(t.VOC_SIZE), "num_chars": int(num_chars or t.NUM_CHARS),
                 "text_decoding": "ctc" if ctc else "slots"}
    return post


def bezier_polygon(ctrl: np.ndarray, samples: int = 10) -> np.ndarray:
    """TESTR's Bézier mode: 8 control points (a cubic along the top, left → right, then one along the bottom,
    right → left) → a closed outline of 2 × samples points."""
    from d2export.cubic import curve

    t = np.linspace(0.0, 1.0, samples)
    return np.concatenate([curve(ctrl[:4], t), curve(ctrl[4:], t)], axis=0)


def text_instances(outputs: dict[str, np.ndarray], index: int, input_hw: tuple[int, int],
                   original_hw: tuple[int, int], post: dict[str, Any], threshold: float) -> list[Instance]:
    """Threshold (≥, as the models do), points back to the original picture, text decoded with the charset."""
    from d2export.charset import decode

    h, w = input_hw
    scale = np.array([original_hw[1] / w, original_hw[0] / h])
    layout = post.get("points") or ("polygon" if post.get("use_polygon", True) else "bezier")
    chars = list(post.get("charset", ""))
    scores = outputs["scores"][index]
    instances = []
    for k in np.flatnonzero(scores >= threshold):
        points = outputs["ctrl_points"][index, k].astype(np.float64)
        inst = Instance(score=float(scores[k]), label=int(outputs["labels"][index, k]))
        if layout == "bezier":  # TESTR clips the curves' end points to the input before scaling
            ends = [0, 3, 4, 7]
            points[ends] = np.clip(points[ends], 0, [w, h])
            inst.beziers = (points * scale).tolist()
            points = bezier_polygon(points)
        inst.polygon = (points * scale).tolist()
        inst.closed = layout != "centre_line"
        if "bd_points" in outputs:
            bd = outputs["bd_points"][index, k].astype(np.float64)
            inst.boundary = (np.concatenate([bd[:, :2], bd[::-1, 2:]]) * scale).tolist()
        if "char_ids" in outputs:
            if "charsets" in post:  # one per script (DeepSolo++): the instance's own
                inst.language = post["languages"][int(outputs["languages"][index, k])]
                chars = list(post["charsets"][inst.language])
            ids, probs = outputs["char_ids"][index, k], outputs["char_scores"][index, k]
            kept = (ids >= 0) & (ids < len(chars))
            inst.text = decode(ids.tolist(), chars, ctc=post.get("text_decoding") == "ctc",
                               unknown=post.get("unknown_id"))
            inst.text_score = float(probs[kept].mean()) if kept.any() else 0.0
        instances.append(inst)
    return instances


class TextSpotter(Family):
    """A DETR-style spotter of the lineage: recognised by its head's attributes (`head`), served by `text_instances`;
    subclasses say how the head's outputs decode (`adapter`) and the manifest's `postprocess`."""
    head: tuple[str, ...] = ()
    priority = 20
    evaluator = "text"
    output_docs = OUTPUT_DOCS
    output_kinds = OUTPUT_KINDS
    # MSDA's sampling locations and weights; the heads that decode boxes, control and boundary points, Beziers; the
    # encoder with the proposals' scoring, which a TopK picks the queries by: quantised there (static, or dynamic
    # on a spotter that reads), the proposal scores moved by 0.13-0.23 and a confident word was swapped or misread;
    # and the text branch (TESTR's *_text decoder sublayers, the character classifier): quantised, a spotter that
    # reads 83% had a confident character's probability 0.08-0.14 off, ids equal; keeping its attention alone or
    # its cross-attention alone float verified on some pictures, not on all
    int8_float_scopes = ("sampling_offsets", "attention_weights", "reference_points", "bbox_embed", "ctrl_point_coord",
                         "bezier_coord_embed", "boundary_offset", "encoder", "enc_output", "bbox_class_embed",
                         "bezier_class_embed", "attn_cross_text", "attn_intra_text", "attn_inter_text", "linear1_text",
                         "linear2_text", "text_class")
    # the trained micro spotter's convolutions quantised statically (MinMax, 16 pictures) moved its proposal logits by
    # 0.45-0.61 and a confident word by 259 px (percentile: 243 px; the backbone kept float: still 259 px, through
    # input_proj): static quantises the MatMuls, as dynamic does, with calibrated activations
    int8_static_ops = ("MatMul", "Gemm")
    # held to accuracy instead (export.int8_recipe=heads): the encoder and the text branch quantised, convolutions
    # too; what decodes points and picks proposals stays float. On the trained micro spotter's 200 held-out pictures
    # (seed 1): detection H-mean -0.87, end-to-end -0.62 against the float32 graph's (docs/precision.md)
    int8_head_scopes = ("sampling_offsets", "attention_weights", "reference_points", "bbox_embed", "ctrl_point_coord",
                        "bezier_coord_embed", "boundary_offset", "enc_output", "bbox_class_embed",
                        "bezier_class_embed", "text_class")

    # where the model's config names its character dictionary, first found first (charset.py)
    charset_keys = ("MODEL.TRANSFORMER.CUSTOM_DICT", "MODEL.BATEXT.CUSTOM_DICT")
    # what the "unknown" class (VOC_SIZE - 1) reads as in the model's own visualizer: TESTR writes '口', DeepSolo
    # nothing
    unknown_reads = ""
    reads_text = True
    built_in_first = False  # DeepSolo's tools take the built-in set for VOC_SIZE 37/96 whatever the config names

    def missing(self, model):
        return lacks(model, self.head)

    def text_charset(self, d2cfg, override=None, search=(), model=None):
        from d2export import charset

        if not self.reads_text:
            return {}
        named = [(key, _config_value(d2cfg, key)) for key in self.charset_keys]
        voc_size = int(d2cfg.MODEL.TRANSFORMER.VOC_SIZE)
        try:
            found = charset.resolve(voc_size, named, override, list(search), self.built_in_first)
        except charset.NoCharset:
            # a table only the model's own code holds (MapTextPipeline's 148 symbols, in its visualizer)
            found = own_table(model, d2cfg, search, voc_size) if model is not None else None
            if found is None:
                raise
        if not self.unknown_reads:
            return found.manifest()
        return charset.Charset(found.chars + (self.unknown_reads,), found.source).manifest() | {
            "unknown_id": voc_size - 1}

    def detr_adapter(self, model, d2cfg, decode, output_names, **decode_options):
        """The generic DETR adapter around the model's head: `decode(raw outputs, image_sizes, **decode_options)`."""
        from functools import partial

        from d2export.tracing.detr import DetrAdapter

        head = find_child(model, self.head)[0]
        return DetrAdapter(model, head, partial(decode, **decode_options), output_names, d2cfg.MODEL.PIXEL_MEAN,
                           d2cfg.MODEL.PIXEL_STD)

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        return text_instances(outputs, index, input_hw, original_hw, post, threshold)


def _config_value(d2cfg, dotted: str) -> str:
    """A yacs key's value as a string ('' where the config lacks it)."""
    node = d2cfg
    for part in dotted.split("."):
        if part not in node:
            return ""
        node = node[part]
    return str(node or "")


def own_table(model, d2cfg, search, voc_size: int):
    """The character table of the model's own visualizer (`CTLABELS`: characters or code points), where it has
    `voc_size - 1` of them; else None."""
    from d2export import charset

    made, where = own_visualizer(model, d2cfg, search)
    table = getattr(made, "CTLABELS", None)
    if table is None or len(table) != voc_size - 1:
        return None
    chars = tuple(chr(c) if isinstance(c, int) else str(c) for c in table)
    return charset.Charset(chars, f"{where}.CTLABELS (the model's own table for VOC_SIZE {voc_size})")
