"""DPText-DETR (ymy-k/DPText-DETR, AdelaiDet lineage): text detection as 16-point polygons, no recognition.

Recognised by its head: a child of the detector with a backbone, per-point class and coordinate heads, and a
transformer that seeds its point queries from box proposals (`init_control_points_from_anchor`, DPText-DETR's prior
point sampling; TESTR's and DeepSolo's transformers have no such method). The adapter calls that head directly
(bypassing the detector's thresholding `inference()`); the outputs are `scores`, `labels` and `ctrl_points`
(see families/_text.py).
"""
from __future__ import annotations

from d2export.families import AdapterOptions
from d2export.families._text import TextSpotter, scores_labels, text_postprocess, to_pixels

HEAD = ("backbone", "transformer.init_control_points_from_anchor", "ctrl_point_class", "ctrl_point_coord")
OUTPUTS = ("scores", "labels", "ctrl_points")


def decode(out: dict, image_sizes) -> tuple:
    scores, labels = scores_labels(out["pred_logits"])
    return scores, labels, to_pixels(out["pred_ctrl_points"], image_sizes)


class DPTextDETR(TextSpotter):
    name = "dptext"
    summary = "DPText-DETR text detector: 16-point polygons"
    head = HEAD
    reads_text = False

    def adapter(self, model, cfg, options: AdapterOptions):
        return self.detr_adapter(model, cfg, decode, OUTPUTS)

    def postprocess(self, cfg):
        return text_postprocess(cfg.MODEL.TRANSFORMER, "polygon" if cfg.MODEL.TRANSFORMER.USE_POLYGON else "bezier")


FAMILY = DPTextDETR()
