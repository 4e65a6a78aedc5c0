"""TESTR (mlpc-ucsd/TESTR, AdelaiDet lineage): polygon or Bézier control points and text from one DETR head.

Recognised by its head: a child of the detector with a backbone, a transformer and TESTR's location and text
branches (`ctrl_point_class`, `ctrl_point_coord`, `text_class`). The adapter calls that head directly (bypassing
the detector's thresholding `inference()`); the outputs are `scores`, `labels`, `ctrl_points`, `char_ids`,
`char_scores` (see families/_text.py), and `text_logits` [N, K, T, voc+1] with export.text_logits=true.
"""
from __future__ import annotations

from d2export.families import AdapterOptions
from d2export.families._text import TextSpotter, best_chars, scores_labels, text_postprocess, to_pixels

HEAD = ("backbone", "transformer", "ctrl_point_class", "ctrl_point_coord", "text_class")
OUTPUTS = ("scores", "labels", "ctrl_points", "char_ids", "char_scores")


def decode(out: dict, image_sizes, text_logits: bool = False) -> tuple:
    scores, labels = scores_labels(out["pred_logits"])
    char_ids, char_scores = best_chars(out["pred_texts"])
    flat = (scores, labels, to_pixels(out["pred_ctrl_points"], image_sizes), char_ids, char_scores)
    return flat + (out["pred_texts"],) if text_logits else flat


class TESTR(TextSpotter):
    name = "testr"
    aliases = ("text_spotter",)
    summary = "TESTR text spotter: polygon/Bézier control points and text"
    head = HEAD

    def adapter(self, model, d2cfg, options: AdapterOptions):
        names = OUTPUTS + (("text_logits",) if options.text_logits else ())
        return self.detr_adapter(model, d2cfg, decode, names, text_logits=options.text_logits)

    unknown_reads = "口"

    def postprocess(self, d2cfg):
        t = d2cfg.MODEL.TRANSFORMER
        ctc = bool(getattr(t, "TEXT_CTC", False))  # a stand-in's option: slots trained with CTC read as DeepSolo's
        return text_postprocess(t, "polygon" if t.USE_POLYGON else "bezier", reads=True, ctc=ctc)


FAMILY = TESTR()
