"""Mask2Former and the segmenters built on its meta-architecture (facebookresearch/Mask2Former's `MaskFormer`):
universal segmentation — semantic, panoptic, instance — from per-query class and mask logits.

Recognised by what the model has: a backbone, `size_divisibility`, pixel normalisation, and a `sem_seg_head` whose
pixel decoder holds multi-scale deformable attention and whose `predictor` is a masked-attention transformer decoder
(`forward_prediction_heads`, `class_embed`, `mask_embed`, `num_queries`). The graph (d2export/tracing/maskformer.py)
outputs what the head hands the model's post-processing:
- `pred_logits` [N, Q, K+1]: class logits per query, the last class "no object";
- `pred_masks` [N, Q, Hp/4, Wp/4]: mask logits per query over the padded batch (Hp, Wp: the batch padded to the
  model's size divisibility, 32); a picture's own part is its top-left (h/4, w/4).
The data-dependent post-processing stays out of the graph: serving computes the semantic map, the panoptic
segments and the instances from these outputs as the model's own three inference functions do
(d2export/families/_mask_predictions.py), with the thresholds of the model's config.
"""
from __future__ import annotations

from d2export.families import AdapterOptions, Family, FamilyError, find_child
from d2export.families._mask_predictions import GRAPH_KINDS

HEAD = ("pixel_decoder", "predictor")
DECODER = ("forward_prediction_heads", "class_embed", "mask_embed", "num_queries")
MODEL = ("backbone", "sem_seg_head", "size_divisibility", "pixel_mean", "pixel_std")
OUTPUT_DOCS = {"pred_logits": "class logits per query [N, Q, K+1]; the last class is 'no object' (MaskDINO: [N, Q, K] "
                              "sigmoid logits)",
               "pred_boxes": "MaskDINO: a box per query [N, Q, 4], cx, cy, w, h relative to the padded batch",
               "pred_masks": "mask logits per query [N, Q, Hp/4, Wp/4] over the batch padded to the model's size "
                             "divisibility; a picture's own part is its top-left (ceil(h/4), ceil(w/4))"}
OUTPUT_KINDS = {"pred_logits": "logits", "pred_masks": "masks", "pred_boxes": "probabilities",
                **GRAPH_KINDS}
OUTPUT_DOCS |= {
    "sem_seg": "export.postprocess=graph: the semantic class per pixel [N, Hp, Wp] over the padded batch",
    "panoptic_query": "export.postprocess=graph: the kept query winning and covering each pixel, -1 where none",
    "query_keep": "export.postprocess=graph: the queries panoptic inference keeps [N, Q]",
    "query_labels": "export.postprocess=graph: each query's class [N, Q]",
    "query_areas": "export.postprocess=graph: per query, pixels won, of its mask, won and covered [N, Q, 3]",
    "instance_scores": "export.postprocess=graph: the top-k (query, class) pairs' scores [N, k]",
    "instance_labels": "export.postprocess=graph: their classes [N, k]",
    "instance_queries": "export.postprocess=graph: their queries [N, k]",
    "instance_masks": "export.postprocess=graph: every query's mask (logit > 0) [N, Q, Hp, Wp]"}


def _has_msda(module) -> bool:
    from d2export.ops.msda_modules import is_msda

    return any(is_msda(m) for m in module.modules())


class Mask2Former(Family):
    name = "mask2former"
    summary = "Mask2Former-style segmenters (MaskFormer meta-architecture): class and mask logits per query"
    priority = 30
    output_docs = OUTPUT_DOCS
    output_kinds = OUTPUT_KINDS
    # seeded weights only: a random class head scores every query ~1/(K+1) and one class wins every pixel; these
    # spread the class and mask logits as a trained model's are, so a comparison can tell graphs apart
    seeded_scales = {"predictor.class_embed": 40.0, "predictor.mask_embed.layers.2": 8.0}
    int8_float_scopes = ("sampling_offsets", "attention_weights")
    pixel_maps = True
    evaluator = "segmentation"  # mIoU, panoptic quality and mask AP, where the dataset has their ground truth
    postprocess_in_graph = True

    def missing(self, model):
        missing = [a for a in MODEL if not hasattr(model, a)]
        if missing:
            return f"needs {', '.join(missing)} (MaskFormer's meta-architecture)"
        try:
            find_child(model.sem_seg_head, HEAD, also_self=True)
            find_child(model.sem_seg_head.predictor, DECODER, also_self=True)
        except FamilyError as e:
            return f"its sem_seg_head {e}"
        if not _has_msda(model.sem_seg_head.pixel_decoder):
            return "its pixel decoder has no multi-scale deformable attention"
        return None

    def adapter(self, model, d2cfg, options: AdapterOptions):
        from d2export.tracing.maskformer import MaskFormerAdapter

        pre = self.preprocess(d2cfg)
        task = str(d2cfg.MODEL.TEST.TASK) if _task_conditioned(model) else None
        boxes = hasattr(model.sem_seg_head.predictor, "bbox_embed")
        from d2export.families._mask_predictions import GRAPH_AXES, graph_output_names

        post = self.postprocess(d2cfg) if options.postprocess == "graph" else None
        results = {name: GRAPH_AXES[name] for name in graph_output_names(post)} if post else None
        return MaskFormerAdapter(model, pre["pixel_mean"], pre["pixel_std"], task, boxes, post, results)

    def postprocess(self, d2cfg):
        from detectron2.data import MetadataCatalog

        test = _test_node(d2cfg)
        num_classes = int(d2cfg.MODEL.SEM_SEG_HEAD.NUM_CLASSES)
        meta = MetadataCatalog.get(d2cfg.DATASETS.TRAIN[0]) if d2cfg.DATASETS.TRAIN else None
        names = next((list(n) for n in (getattr(meta, "stuff_classes", None), getattr(meta, "thing_classes", None))
                      if n and len(n) == num_classes), [])
        things = getattr(meta, "thing_dataset_id_to_contiguous_id", None) or {}
        return {"num_classes": num_classes,
                "object_mask_threshold": float(test.OBJECT_MASK_THRESHOLD),
                "overlap_threshold": float(test.OVERLAP_THRESHOLD),
                "test_topk_per_image": int(d2cfg.TEST.DETECTIONS_PER_IMAGE),
                "semantic_on": bool(test.SEMANTIC_ON), "panoptic_on": bool(test.PANOPTIC_ON),
                "instance_on": bool(test.INSTANCE_ON),
                # as the model decides it (maskformer_model.py): any of panoptic/instance forces it
                "sem_seg_postprocess_before_inference": bool(test.SEM_SEG_POSTPROCESSING_BEFORE_INFERENCE
                                                             or test.PANOPTIC_ON or test.INSTANCE_ON),
                "thing_ids": sorted(int(v) for v in things.values()),
                "class_names": names} | _maskdino_rules(d2cfg) | _oneformer_rules(d2cfg, meta) | (
                    {"task": str(task)} if (task := getattr(d2cfg.MODEL.get("TEST"), "TASK", None)) else {})

    def prediction(self, outputs, index, input_hw, original_hw, post, threshold):
        from d2export.families._mask_predictions import graph_prediction, mask_prediction

        predict = graph_prediction if post.get("in_graph") else mask_prediction
        return predict(outputs, index, input_hw, original_hw, post, threshold)

    def instances(self, outputs, index, input_hw, original_hw, post, threshold):
        return self.prediction(outputs, index, input_hw, original_hw, post, threshold).instances


def _task_conditioned(model) -> bool:
    """OneFormer: the head takes a task embedding beside the features."""
    return hasattr(model, "task_mlp") and hasattr(model, "task_tokenizer")


def _maskdino_rules(d2cfg) -> dict:
    """MaskDINO scores classes by a sigmoid, K of them (d2export/families/_mask_rules.py's Rules), with the settings of
    its TEST node as its from_config reads them."""
    if not hasattr(d2cfg.MODEL, "MaskDINO"):
        return {"class_scores": "softmax"}
    node = d2cfg.MODEL.MaskDINO
    test = node.TEST
    return {"class_scores": "sigmoid", "transform_eval": bool(test.PANO_TRANSFORM_EVAL),
            "panoptic_temperature": float(test.PANO_TEMPERATURE), "focus_on_box": bool(test.TEST_FOUCUS_ON_BOX),
            "semantic_ce_loss": bool(test.SEMANTIC_ON and node.SEMANTIC_CE_LOSS and not test.PANOPTIC_ON)}


def _oneformer_rules(d2cfg, meta) -> dict:
    """OneFormer's instance rules (its instance_inference; d2export/families/_mask_rules.py's Rules): its demo mode
    keeps the pairs scoring over the object threshold; on ADE20K (the dataset's name says it) the instance task numbers
    classes among the things' dataset ids; DETECTION_ON boxes the masks."""
    if not hasattr(d2cfg.MODEL, "ONE_FORMER"):
        return {}
    demo, test = bool(d2cfg.MODEL.get("IS_DEMO", False)), d2cfg.MODEL.TEST
    rules = {"boxes_from_masks": bool(test.get("DETECTION_ON", False))}
    if demo:
        rules["instance_min_score"] = float(test.OBJECT_MASK_THRESHOLD)
    things = getattr(meta, "thing_dataset_id_to_contiguous_id", None) or {}
    if "ade20k" in getattr(meta, "name", "") and not demo and "instance" in str(test.get("TASK", "")):
        rules["instance_label_ids"] = [int(k) for k in things]  # in the metadata's order, as upstream's list
    return rules


def _test_node(d2cfg):
    """The post-processing's config: Mask2Former's MODEL.MASK_FORMER.TEST, MaskDINO's MODEL.MaskDINO.TEST, or
    OneFormer's MODEL.TEST."""
    for project in ("MASK_FORMER", "MaskDINO"):
        if hasattr(d2cfg.MODEL, project) and hasattr(d2cfg.MODEL.get(project), "TEST"):
            return d2cfg.MODEL.get(project).TEST
    return d2cfg.MODEL.TEST


FAMILY = Mask2Former()
