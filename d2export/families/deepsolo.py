"""DeepSolo (ViTAE-Transformer/DeepSolo, AdelaiDet lineage): text centre lines as point sequences, a character per
point, and boundary points around the line.

Recognised by its head: a child of the detector with a backbone, per-point class, coordinate and character heads
(`ctrl_point_text`), and a transformer that samples its point queries from Bezier proposals
(`init_points_from_bezier_proposals`). The adapter calls that head directly (bypassing the detector's thresholding
`inference()`); the outputs are `scores`, `labels`, `ctrl_points` (the centre line), `char_ids`, `char_scores` and,
where the model has the boundary head, `bd_points` (see families/_text.py); `text_logits` [N, K, P, voc+1] with
export.text_logits=true. Text reads as DeepSolo's own: runs of one character collapse, "unknown" and "none" separate.
"""
from __future__ import annotations

from d2export.families import AdapterOptions
from d2export.families._text import (TextSpotter, best_chars, head_outputs, scores_labels, text_postprocess,
                                    to_pixels)

HEAD = ("backbone", "transformer.init_points_from_bezier_proposals", "ctrl_point_class", "ctrl_point_coord",
        "ctrl_point_text")
OUTPUTS = ("scores", "labels", "ctrl_points", "char_ids", "char_scores")


def decode(out, image_sizes, boundary: bool = True, text_logits: bool = False) -> tuple:
    out = head_outputs(out)
    scores, labels = scores_labels(out["pred_logits"])
    char_ids, char_scores = best_chars(out["pred_text_logits"])
    flat = (scores, labels, to_pixels(out["pred_ctrl_points"], image_sizes), char_ids, char_scores)
    if boundary:
        flat += (to_pixels(out["pred_bd_points"], image_sizes),)
    return flat + (out["pred_text_logits"],) if text_logits else flat


class DeepSolo(TextSpotter):
    name = "deepsolo"
    summary = "DeepSolo text spotter: centre lines, boundaries and text"
    head = HEAD
    built_in_first = True

    def adapter(self, model, cfg, options: AdapterOptions):
        from d2export.families import find_child

        boundary = getattr(find_child(model, HEAD)[1], "boundary_offset", None) is not None
        names = OUTPUTS + (("bd_points",) if boundary else ()) + (("text_logits",) if options.text_logits else ())
        return self.detr_adapter(model, cfg, decode, names, boundary=boundary, text_logits=options.text_logits)

    def postprocess(self, cfg):
        t = cfg.MODEL.TRANSFORMER
        return text_postprocess(t, "centre_line", reads=True, ctc=True, num_chars=int(t.NUM_POINTS))


FAMILY = DeepSolo()
