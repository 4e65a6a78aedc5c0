"""detectron2's RetinaNet (and other DenseDetector one-stage heads): boxes, scores, labels.

Recognised by DenseDetector's `forward_inference(images, features, predictions)`; RetinaNet has no
`inference(..., do_postprocess=)` for the rcnn family to call. The graph runs what DenseDetector.forward runs at test
time, before detector_postprocess; outputs and serving as the rcnn family's (d2export/tracing/rcnn.py,
d2export/families/_detections.py).
"""
from __future__ import annotations

from d2export.families import AdapterOptions
from d2export.families._detections import Detectron2Detections, detection_postprocess

NEEDS = ("preprocess_image", "backbone", "head", "head_in_features", "forward_inference")


def inference(model, inputs: list) -> dict:
    """DenseDetector.forward at test time, without detector_postprocess: one image's raw detections."""
    from d2export.tracing.rcnn import instance_tensors

    images = model.preprocess_image(inputs)
    features = model.backbone(images.tensor)
    features = [features[f] for f in model.head_in_features]
    return instance_tensors(model.forward_inference(images, features, model.head(features))[0])


class RetinaNet(Detectron2Detections):
    name = "retinanet"
    summary = "detectron2 RetinaNet (one-stage dense detectors): boxes"
    priority = 80

    def missing(self, model):
        lacking = [a for a in NEEDS if not hasattr(model, a)]
        return f"needs DenseDetector's {', '.join(lacking)}" if lacking else None

    def adapter(self, model, d2cfg, options: AdapterOptions):
        from d2export.tracing.rcnn import RCNNAdapter

        return RCNNAdapter(model, options.example[0], inference)

    def postprocess(self, d2cfg):
        return detection_postprocess(d2cfg, d2cfg.MODEL.RETINANET.SCORE_THRESH_TEST, num_classes="retinanet")


FAMILY = RetinaNet()
