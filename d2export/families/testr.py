"""TESTR (mlpc-ucsd/TESTR, AdelaiDet lineage): polygon or Bézier control points and text from one DETR head.

Recognised by its head: a child of the detector with a backbone, a transformer and TESTR's location and text
branches (`ctrl_point_class`, `ctrl_point_coord`, `text_class`). The adapter calls that head directly (bypassing
the detector's thresholding `inference()`); the outputs are `scores`, `labels`, `ctrl_points`, `char_ids`,
`char_scores` (see families/_text.py), and `text_logits` [N, K, T, voc+1] with export.text_logits=true.
"""
from __future__ import annotations

from functools import partial

from d2export.families import AdapterOptions, Family, find_child, lacks
from d2export.families._text import best_chars, scores_labels, text_instances, text_postprocess, to_pixels

HEAD = ("backbone", "transformer", "ctrl_point_class", "ctrl_point_coord", "text_class")
OUTPUTS = ("scores", "labels", "ctrl_points", "char_ids", "char_scores")


def decode(out: dict, image_sizes, text_logits: bool = False) -> tuple:
    scores, labels = scores_labels(out["pred_logits"])
    char_ids, char_scores = best_chars(out["pred_texts"])
    flat = (scores, labels, to_pixels(out["pred_ctrl_points"], image_sizes), char_ids, char_scores)
    return flat + (out["pred_texts"],) if text_logits else flat


class TESTR(Family):
    name = "testr"
    aliases = ("text_spotter",)
    summary = "TESTR text spotter: polygon/Bézier control points and text"
    priority = 20

    def missing(self, model):
        return lacks(model, HEAD)

    def adapter(self, model, cfg, options: AdapterOptions):
        from d2export.tracing.detr import DetrAdapter

        head, _ = find_child(model, HEAD)
        names = OUTPUTS + (("text_logits",) if options.text_logits else ())
        return DetrAdapter(model, head, partial(decode, text_logits=options.text_logits), names,
                           cfg.MODEL.PIXEL_MEAN, cfg.MODEL.PIXEL_STD)

    def postprocess(self, cfg):
        return text_postprocess(cfg.MODEL.TRANSFORMER, "polygon" if cfg.MODEL.TRANSFORMER.USE_POLYGON else "bezier")

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        return text_instances(outputs, index, input_hw, original_hw, post, threshold)


FAMILY = TESTR()
