"""One-to-one assignment of queries to ground-truth words (Hungarian, on a cost per pair), as TESTR trains: decoder
queries by their class and control points, the encoder's proposals by class, box and GIoU."""
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou


def focal_class_cost(prob, alpha, gamma):
    """(…, C) probabilities → the focal loss of calling each positive minus that of calling it negative: low where
    the query is confident, the class term of the matching cost."""
    positive = alpha * (1 - prob) ** gamma * -(prob + 1e-8).log()
    negative = (1 - alpha) * prob ** gamma * -(1 - prob + 1e-8).log()
    return positive - negative


def assign(costs):
    """Per image, a (queries, targets) cost matrix → (query indices, target indices), each used once."""
    pairs = []
    for c in costs:
        rows, cols = linear_sum_assignment(c.detach().cpu().numpy()) if c.numel() else ([], [])
        pairs.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
    return pairs


class CtrlPointHungarianMatcher(nn.Module):
    """Decoder queries ↔ words: class cost (the focal term averaged over a query's points) plus the L1 distance
    between its control points and the word's, each weighted; with `ref_weight`, plus the L1 distance between the
    query's reference centre and the word's box centre (where its text branch samples)."""

    def __init__(self, class_weight=2.0, coord_weight=5.0, focal_alpha=0.25, focal_gamma=2.0, ref_weight=0.0):
        super().__init__()
        self.class_weight, self.coord_weight, self.ref_weight = class_weight, coord_weight, ref_weight
        self.alpha, self.gamma = focal_alpha, focal_gamma

    def forward(self, outputs, targets):
        return assign(self.costs(outputs, targets))

    @torch.no_grad()
    def costs(self, outputs, targets):
        """Per image, the (queries, words) cost matrix."""
        prob = outputs["pred_logits"].sigmoid()  # (B, Q, P, 1)
        points = outputs["pred_ctrl_points"].flatten(-2)  # (B, Q, P * 2)
        costs = []
        for b, t in enumerate(targets):
            cls = focal_class_cost(prob[b, ..., 0], self.alpha, self.gamma).mean(-1, keepdim=True)  # (Q, 1)
            coord = torch.cdist(points[b], t["ctrl_points"].flatten(-2).to(points.dtype), p=1)  # (Q, n)
            cost = self.class_weight * cls + self.coord_weight * coord
            if self.ref_weight and "pred_references" in outputs:
                centres = outputs["pred_references"][b, :, :2]
                cost = cost + self.ref_weight * torch.cdist(centres, t["boxes"][:, :2].to(centres.dtype), p=1)
            costs.append(cost)
        return costs


class BoxHungarianMatcher(nn.Module):
    """The encoder's proposals ↔ words' boxes: class cost, L1 between (cx, cy, w, h) boxes and negative GIoU."""

    def __init__(self, class_weight=2.0, coord_weight=5.0, giou_weight=2.0, focal_alpha=0.25, focal_gamma=2.0):
        super().__init__()
        self.class_weight, self.coord_weight, self.giou_weight = class_weight, coord_weight, giou_weight
        self.alpha, self.gamma = focal_alpha, focal_gamma

    def forward(self, outputs, targets):
        return assign(self.costs(outputs, targets))

    @torch.no_grad()
    def costs(self, outputs, targets):
        """Per image, the (proposals, words) cost matrix."""
        prob = outputs["pred_logits"].sigmoid()  # (B, S, 1)
        boxes = outputs["pred_boxes"]  # (B, S, 4) cx, cy, w, h in [0, 1]
        costs = []
        for b, t in enumerate(targets):
            cls = focal_class_cost(prob[b], self.alpha, self.gamma)[:, t["labels"]]  # (S, n)
            tgt = t["boxes"].to(boxes.dtype)
            l1 = torch.cdist(boxes[b], tgt, p=1)
            giou = generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy"))
            costs.append(self.class_weight * cls + self.coord_weight * l1 - self.giou_weight * giou)
        return costs
