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

    def adapter(self, model, d2cfg, options: AdapterOptions):
        from d2export.families import find_child

        boundary = getattr(find_child(model, HEAD)[1], "boundary_offset", None) is not None
        names = OUTPUTS + (("bd_points",) if boundary else ()) + (("text_logits",) if options.text_logits else ())
        return self.detr_adapter(model, d2cfg, decode, names, boundary=boundary, text_logits=options.text_logits)

    def postprocess(self, d2cfg):
        t = d2cfg.MODEL.TRANSFORMER
        return text_postprocess(t, "centre_line", reads=True, ctc=True, num_chars=int(t.NUM_POINTS))


    def missing(self, model):
        from d2export.families import find_child

        lacking = super().missing(model)
        if lacking is None and hasattr(find_child(model, HEAD)[1], "inst_language"):
            return "one text head per script and a language head (inst_language): family 'deepsolo_plus' reads it"
        return lacking


# DeepSolo++ (ViTAE-Transformer/DeepSolo, DeepSolo++/): what differs is declared here. Its head classifies each
# query's script (`inst_language`) and holds one text head per script (`ctrl_point_text`: a list of vocabularies of
# their own sizes, index 0 the blank); its inference reads a query's characters from its script's head. The graph
# routes them the same way (`char_ids` / `char_scores` from the query's script, `languages` the script's index); the
# runtime reads each with its script's `char_map/idx2char/<Lang>.json`.
PLUS_HEAD = HEAD + ("inst_language",)


def decode_plus(out, image_sizes) -> tuple:
    import torch

    scores, labels = scores_labels(out["pred_logits"])
    languages = out["pred_lan_logits"].softmax(-1).argmax(-1)  # [N, K], as its inference picks the head
    best = [best_chars(logits) for logits in out["pred_text_logits"]]
    pick = languages[None, :, :, None].expand(1, *best[0][0].shape)
    char_ids = torch.stack([ids for ids, _ in best]).gather(0, pick)[0]
    char_scores = torch.stack([probs for _, probs in best]).gather(0, pick)[0]
    return (scores, labels, to_pixels(out["pred_ctrl_points"], image_sizes), char_ids, char_scores,
            to_pixels(out["pred_bd_points"], image_sizes), languages)


class DeepSoloPlus(DeepSolo):
    name = "deepsolo_plus"
    summary = "DeepSolo++ multilingual text spotter: centre lines, boundaries, a script and its text per instance"
    head = PLUS_HEAD

    def missing(self, model):
        return TextSpotter.missing(self, model)

    def adapter(self, model, d2cfg, options: AdapterOptions):
        return self.detr_adapter(model, d2cfg, decode_plus, OUTPUTS + ("bd_points", "languages"))

    def text_charset(self, d2cfg, override=None, search=(), model=None):
        """One dictionary per script, as its visualizer opens them: `char_map/idx2char/<Lang>.json` (from the
        working directory, else beside model.sys_path and the config's folders; model.charset= a folder holding
        them), each of its script's VOC_SIZES entries, 1-based (0 the blank)."""
        import hashlib
        import json
        from pathlib import Path

        from d2export import charset

        lang = d2cfg.MODEL.TRANSFORMER.LANGUAGE
        folder = Path(override) if override else Path("char_map/idx2char")
        charsets, paths = {}, []
        for name, voc_size in lang.VOC_SIZES:
            path = charset.locate(str(folder / f"{name}.json"), list(search))
            chars = charset.read_file(path)
            if chars[:1] != [""] or len(chars) - 1 != int(voc_size):
                raise charset.CharsetError(f"{path}: {len(chars) - (chars[:1] == [''])} characters from index "
                                           f"{0 if chars[:1] != [''] else 1}; {name}'s VOC_SIZES entry reads "
                                           f"{int(voc_size)} from index 1 (0 the blank)")
            charsets[str(name)] = chars
            paths.append(str(path))
        digest = hashlib.sha256(json.dumps(charsets, ensure_ascii=False, sort_keys=True).encode()).hexdigest()
        return {"charsets": charsets, "languages": [str(c) for c in lang.CLASSES],
                "charset_source": f"{'model.charset' if override else 'char_map/idx2char'}: {', '.join(paths)}",
                "charset_sha256": digest}


FAMILY = DeepSolo()
FAMILIES = (FAMILY, DeepSoloPlus())
