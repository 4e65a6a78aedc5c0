"""DPText-DETR (ymy-k/DPText-DETR, AdelaiDet lineage): text detection as 16-point polygons, no recognition; and
SRFormer (retsuh-bqw/SRFormer-Text-Det), its variant with a segmentation branch.

Recognised by its head: a child of the detector with a backbone, per-point class and coordinate heads, and a
transformer that seeds its point queries from box proposals (`init_control_points_from_anchor`, DPText-DETR's prior
point sampling; TESTR's and DeepSolo's transformers have no such method). The adapter calls that head directly
(bypassing the detector's thresholding `inference()`); the outputs are `scores`, `labels` and `ctrl_points`
(see families/_text.py).

SRFormer differs in what is declared below: its head (child `srformer`) regresses points by offsets
(`offset_embed`, no `ctrl_point_coord`) beside a mask branch (`mask_embed`), and its class logits are per query
([N, K, C], not per point): its inference scores them `sigmoid().max(-1)`. Its mask branch is in the graph: inference
uses it (mask-guided query features, the mask as an anchor prior for the points), size-general through the same
patches (linspace grids over the mask's height and width, the levels split by start-index differences).
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

    def adapter(self, model, d2cfg, options: AdapterOptions):
        return self.detr_adapter(model, d2cfg, decode, OUTPUTS)

    def postprocess(self, d2cfg):
        return text_postprocess(d2cfg.MODEL.TRANSFORMER, "polygon" if d2cfg.MODEL.TRANSFORMER.USE_POLYGON else "bezier")


SRFORMER_HEAD = ("backbone", "transformer.init_control_points_from_anchor", "ctrl_point_class", "offset_embed",
                 "mask_embed")


def decode_srformer(out: dict, image_sizes) -> tuple:
    scores, labels = out["pred_logits"].sigmoid().max(-1)  # per query, as SRFormer's inference()
    return scores, labels, to_pixels(out["pred_ctrl_points"], image_sizes)


class SRFormer(DPTextDETR):
    name = "srformer"
    summary = "SRFormer text detector: 16-point polygons (DPText-DETR's lineage, a mask branch for training)"
    head = SRFORMER_HEAD

    def adapter(self, model, d2cfg, options: AdapterOptions):
        return self.detr_adapter(model, d2cfg, decode_srformer, OUTPUTS)


FAMILY = DPTextDETR()
FAMILIES = (FAMILY, SRFormer())  # the module's variants, each recognised by its own head
