"""Detections in two shapes, each the mirror of the other: detectron2's `Instances`, as a model's own inference
returns them and evaluators read them, and d2export's `Prediction`, as the runtime serves, draws and compares them.
Both are in the original picture's pixels; fields map one to one:

    scores ↔ score            pred_classes ↔ label        pred_boxes ↔ box         pred_masks ↔ mask (RLE)
    pred_keypoints ↔ keypoints   polygons ↔ polygon (closed outline)   beziers ↔ beziers (+ its outline)
    ctrl_points ↔ polygon (an open centre line)   bd ↔ boundary   recs (ids) ↔ text, `texts` keeps the strings

Text reads with the model's character set and decoding (the manifest's `postprocess`: `charset`, `text_decoding`).
A segmenter's whole output dict mirrors a Prediction's served kinds too (`to_outputs`, `prediction_of`), each as its
declaration says (d2export/served_kinds/: `from_detectron2`, `to_detectron2`):

    sem_seg [K, H, W] scores ↔ semantic (their argmax)    panoptic_seg (ids, segments_info) ↔ panoptic, segments
"""
from __future__ import annotations

from typing import Any

import numpy as np

from d2export.charset import decode
from d2export.families._text import bezier_polygon
from d2export.instances import Instance, Prediction, decode_mask, encode_mask
from d2export.served_kinds import kinds


def _rows(value) -> np.ndarray:
    return value.detach().cpu().double().numpy() if hasattr(value, "detach") else np.asarray(value, np.float64)


def read_text(ids, post: dict[str, Any]) -> str:
    return decode([int(i) for i in ids], list(post.get("charset", "")), ctc=post.get("text_decoding") == "ctc",
                  unknown=post.get("unknown_id"))


def to_prediction(instances, post: dict[str, Any]) -> Prediction:
    """A model's own `Instances` (on the CPU) → Prediction."""
    height, width = instances.image_size
    fields = {name: _rows(value.tensor if hasattr(value, "tensor") else value)
              for name, value in instances.get_fields().items() if name not in ("texts", "bd")}  # each field once
    n = len(instances)
    scores, labels = fields.get("scores", np.ones(n)), fields.get("pred_classes", np.zeros(n))
    names = post.get("class_names")
    found = []
    for k in range(n):
        label = int(labels[k])
        inst = Instance(score=float(scores[k]), label=label,
                        class_name=names[label] if names and 0 <= label < len(names) else None)
        if "pred_boxes" in fields:
            inst.box = fields["pred_boxes"][k].tolist()
        if "pred_masks" in fields:
            inst.mask = encode_mask(fields["pred_masks"][k] > 0.5)
        if "pred_keypoints" in fields:
            inst.keypoints = fields["pred_keypoints"][k].tolist()
        if "polygons" in fields:
            inst.polygon = fields["polygons"][k].reshape(-1, 2).tolist()
        elif "beziers" in fields:
            ctrl = fields["beziers"][k].reshape(-1, 2)
            inst.beziers, inst.polygon = ctrl.tolist(), bezier_polygon(ctrl).tolist()
        elif "ctrl_points" in fields:
            inst.polygon, inst.closed = fields["ctrl_points"][k].reshape(-1, 2).tolist(), False
        if instances.has("bd") and instances.bd[k] is not None:  # DeepSolo: a list, None where it has no boundary
            bd = _rows(instances.bd[k]).reshape(-1, 4)
            inst.boundary = np.concatenate([bd[:, :2], bd[::-1, 2:]]).tolist()
        if instances.has("texts"):
            inst.text = instances.texts[k]
        elif "recs" in fields:
            inst.text = read_text(fields["recs"][k].astype(np.int64), post)
        found.append(inst)
    return Prediction(int(height), int(width), found)


def to_instances(prediction: Prediction, post: dict[str, Any]):
    """Prediction → detectron2 `Instances` with the fields a model's own inference gives, for any evaluator: `recs`
    holds the text re-encoded as slot ids (exact for slot decoding; a CTC model's runs are not restored, so `texts`
    keeps the strings too: d2export's text evaluator reads those)."""
    import torch
    from detectron2.structures import Boxes, Instances

    found = prediction.instances
    out = Instances((prediction.height, prediction.width))
    out.scores = torch.tensor([i.score for i in found], dtype=torch.float32)
    out.pred_classes = torch.tensor([i.label for i in found], dtype=torch.int64)
    if not found:
        return out
    first = found[0]
    tensor = lambda rows: torch.as_tensor(np.asarray(rows, dtype=np.float32))  # noqa: E731
    if first.box is not None:
        out.pred_boxes = Boxes(tensor([i.box for i in found]))
    if first.mask is not None:
        out.pred_masks = torch.as_tensor(np.stack([decode_mask(i.mask) for i in found]))
    if first.keypoints is not None:
        out.pred_keypoints = tensor([i.keypoints for i in found])
    if first.beziers is not None:
        out.beziers = tensor([np.ravel(i.beziers) for i in found])
    elif first.polygon is not None:
        field = "polygons" if first.closed else "ctrl_points"
        out.set(field, tensor([np.ravel(i.polygon) for i in found]))
    if first.boundary is not None:
        bd = [np.asarray(i.boundary).reshape(-1, 2) for i in found]
        half = len(bd[0]) // 2
        out.bd = tensor([np.concatenate([b[:half], b[half:][::-1]], axis=1) for b in bd])
    if first.text is not None:
        chars = list(post.get("charset", ""))
        index = {c: n for n, c in enumerate(chars)}
        slots = int(post.get("num_chars", 25))
        out.recs = torch.tensor([[index.get(c, len(chars) - 1) for c in i.text[:slots]]
                                 + [len(chars)] * (slots - len(i.text[:slots])) for i in found], dtype=torch.int32)
        out.texts = [i.text for i in found]
    return out


def prediction_of(output: dict[str, Any], post: dict[str, Any]) -> Prediction:
    """A model's whole output dict for one picture (detectron2's: `instances`, and a segmenter's `sem_seg`,
    `panoptic_seg`: each served kind's `from_detectron2`) → Prediction."""
    values = {k.name: k.from_detectron2(output, post) for k in kinds("picture") if k.from_detectron2 is not None}
    values = {name: value for name, value in values.items() if value is not None}
    if "instances" in output:
        prediction = to_prediction(output["instances"].to("cpu"), post)
    else:  # a semantic or panoptic segmenter only: the picture's size is its first map's
        first = next(v for v in values.values() if isinstance(v, np.ndarray))
        prediction = Prediction(*map(int, first.shape[-2:]))
    for name, value in values.items():
        setattr(prediction, name, value)
    return prediction


def to_outputs(prediction: Prediction, post: dict[str, Any]) -> dict[str, Any]:
    """Prediction → the output dict a model's own inference gives, for any evaluator: `instances` (to_instances;
    left out where the manifest says the model makes none: `instance_on` false), then each served kind's entries
    (`to_detectron2`): `sem_seg` one-hot [K, H, W] uint8 scores (K: `num_classes`), whose argmax is the served map
    (the runtime keeps the map, not the scores); `panoptic_seg` (ids, segments_info)."""
    out = {"instances": to_instances(prediction, post)} if post.get("instance_on", True) else {}
    for kind in kinds("picture"):
        if kind.to_detectron2 is not None:
            out.update(kind.to_detectron2(prediction, post))
    return out
