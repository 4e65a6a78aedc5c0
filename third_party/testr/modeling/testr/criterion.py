"""TESTR's training losses, given the matches: sigmoid focal classification, L1 on the control points and
cross-entropy on the characters for the decoder's queries (on the last layer and, as auxiliary losses, on every
earlier one); focal classification, L1 and GIoU on the boxes of the encoder's proposals (two-stage).

Normalisation: every loss is summed over images and divided by the number of words in the batch (at least 1), except
the characters' cross-entropy, a mean over the matched queries' character slots (padding slots included: "no
character" is a class the model must predict). With `ctc` (not upstream's) the characters' loss is CTC with "no
character" as the blank, a mean over the matched words of their loss per character, as DeepSolo's."""
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou_loss, sigmoid_focal_loss

from testr.modeling.testr.matcher import BoxHungarianMatcher, CtrlPointHungarianMatcher


def _matched(pairs, logits):
    """Per-image (queries, targets) pairs → (batch index, query index) of every matched query, and the (B, Q) mask of
    them over `logits`' queries."""
    batch = torch.cat([torch.full_like(q, b) for b, (q, _) in enumerate(pairs)])
    query = torch.cat([q for q, _ in pairs])
    positive = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
    positive[batch, query] = True
    return batch, query, positive


class SetCriterion(nn.Module):
    def __init__(self, loss_cfg, voc_size, ctc=False):
        super().__init__()
        c = loss_cfg
        self.alpha, self.gamma, self.voc_size, self.ctc = c.FOCAL_ALPHA, c.FOCAL_GAMMA, voc_size, ctc
        self.aux = c.AUX_LOSS
        self.point_matcher = CtrlPointHungarianMatcher(c.POINT_CLASS_WEIGHT, c.POINT_COORD_WEIGHT, c.FOCAL_ALPHA,
                                                       c.FOCAL_GAMMA, c.POINT_REF_WEIGHT)
        self.box_matcher = BoxHungarianMatcher(c.BOX_CLASS_WEIGHT, c.BOX_COORD_WEIGHT, c.BOX_GIOU_WEIGHT,
                                               c.FOCAL_ALPHA, c.FOCAL_GAMMA)
        self.weights = {"loss_ce": c.POINT_CLASS_WEIGHT, "loss_ctrl_points": c.POINT_COORD_WEIGHT,
                        "loss_texts": c.POINT_TEXT_WEIGHT, "loss_enc_ce": c.BOX_CLASS_WEIGHT,
                        "loss_enc_bbox": c.BOX_COORD_WEIGHT, "loss_enc_giou": c.BOX_GIOU_WEIGHT,
                        "loss_char_centres": c.CHAR_CENTRE_WEIGHT}

    def focal(self, logits, positive, num_words):
        """(B, Q, …, 1) logits, (B, Q) bool → the focal loss over every element, a query's points averaged."""
        target = positive.to(logits.dtype).view(*positive.shape, *([1] * (logits.dim() - 2))).expand_as(logits)
        loss = sigmoid_focal_loss(logits, target, self.alpha, self.gamma, reduction="none")
        if loss.dim() == 4:  # (B, Q, P, C): mean over the points
            loss = loss.mean(2)
        return loss.sum() / num_words

    def query_losses(self, outputs, targets, num_words):
        pairs = self.point_matcher(outputs, targets)
        b, q, positive = _matched(pairs, outputs["pred_logits"])
        points = outputs["pred_ctrl_points"][b, q]
        target_points = torch.cat([t["ctrl_points"][i] for t, (_, i) in zip(targets, pairs)]).to(points.dtype)
        texts = outputs["pred_texts"][b, q]  # (n, T, V + 1)
        target_texts = torch.cat([t["texts"][i] for t, (_, i) in zip(targets, pairs)]).long()
        text_loss = self.text_loss(texts, target_texts) if len(texts) else texts.sum()
        return {"loss_ce": self.focal(outputs["pred_logits"], positive, num_words),
                "loss_ctrl_points": F.l1_loss(points, target_points, reduction="sum") / num_words,
                "loss_texts": text_loss}

    def text_loss(self, logits, targets):
        """(n, T, V + 1) logits, (n, T) labels padded with V ("no character") → the characters' loss."""
        if not self.ctc:
            return F.cross_entropy(logits.transpose(1, 2), targets)
        lengths = (targets != self.voc_size).sum(1)
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # (T, n, V + 1)
        steps = torch.full_like(lengths, logits.shape[1])
        # zero_infinity: a word the slots cannot hold (repeats need a blank between) teaches nothing
        return F.ctc_loss(log_probs, targets, steps, lengths, blank=self.voc_size, zero_infinity=True)

    def encoder_losses(self, outputs, targets, num_words):
        pairs = self.box_matcher(outputs, targets)
        b, q, positive = _matched(pairs, outputs["pred_logits"])
        boxes = outputs["pred_boxes"][b, q]
        target = torch.cat([t["boxes"][i] for t, (_, i) in zip(targets, pairs)]).to(boxes.dtype)
        giou = generalized_box_iou_loss(box_convert(boxes, "cxcywh", "xyxy"), box_convert(target, "cxcywh", "xyxy"),
                                        reduction="sum")
        return {"loss_enc_ce": self.focal(outputs["pred_logits"], positive, num_words),
                "loss_enc_bbox": F.l1_loss(boxes, target, reduction="sum") / num_words,
                "loss_enc_giou": giou / num_words}

    def forward(self, outputs, targets):
        """Unweighted losses by name (`_<i>` for the i-th auxiliary decoder layer); `weights` weighs them."""
        num_words = max(sum(len(t["labels"]) for t in targets), 1)
        losses = self.query_losses(outputs, targets, num_words)
        for i, aux in enumerate(outputs.get("aux_outputs", []) if self.aux else []):
            aux = {**aux, "pred_references": outputs["pred_references"]} if "pred_references" in outputs else aux
            losses.update({f"{k}_{i}": v for k, v in self.query_losses(aux, targets, num_words).items()})
        if "enc_outputs" in outputs:
            losses.update(self.encoder_losses(outputs["enc_outputs"], targets, num_words))
        return losses

    def weight(self, name):
        return self.weights[name.rsplit("_", 1)[0] if name[-1].isdigit() else name]


def character_centres(points, texts, voc_size):
    """Each word's characters' estimated centres: (m, 2) points in the control points' units and (m,) class ids.
    `points` (n, K, 2): the top outline left to right, then the bottom right to left (polygon points or Bézier
    control points: both are read as polylines); `texts` (n, T) padded with voc_size. The i-th of L characters sits
    at u = (i + 0.5) / L along the midline between the two outlines."""
    half = points.shape[1] // 2
    top, bottom = points[:, :half], points[:, half:].flip(1)
    known = texts < voc_size  # labels are left-aligned: the first `length` slots
    word, slot = known.nonzero(as_tuple=True)
    length = known.sum(1)[word].to(points.dtype)
    f = (slot.to(points.dtype) + 0.5) / length * (half - 1)
    lo = f.floor().long().clamp(max=half - 2)
    frac = (f - lo.to(points.dtype))[:, None]
    mid = (top + bottom) / 2
    return mid[word, lo] * (1 - frac) + mid[word, lo + 1] * frac, texts[word, slot].long()


def char_centre_loss(classifier, features, targets, image_sizes, padded_hw, voc_size):
    """Cross-entropy of `classifier` reading `features` (B, C, h, w: the finest map of the batch padded to
    `padded_hw`) at every target character's centre; targets' control points are relative to each unpadded image
    (`image_sizes`: (h, w) each)."""
    padded = features.new_tensor([float(padded_hw[0]), float(padded_hw[1])])
    logits, labels = [], []
    for b, (t, (h, w)) in enumerate(zip(targets, image_sizes)):
        if not len(t["texts"]):
            continue
        centres, ids = character_centres(t["ctrl_points"], t["texts"], voc_size)
        grid = centres * features.new_tensor([w, h]) / padded.flip(0) * 2 - 1  # [-1, 1] edge to edge
        sampled = F.grid_sample(features[b:b + 1], grid[None, None].to(features.dtype), align_corners=False)
        logits.append(classifier(sampled[0, :, 0].T))
        labels.append(ids)
    if not logits:
        return features.sum() * 0
    return F.cross_entropy(torch.cat(logits), torch.cat(labels))
