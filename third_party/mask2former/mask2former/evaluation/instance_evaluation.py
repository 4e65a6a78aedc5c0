"""`InstanceSegEvaluator`: COCO evaluation of MaskFormer instance predictions.

As upstream, this module imports detectron2's `fast_eval_api` at top level, which imports detectron2's compiled
`_C`: on a detectron2 built without it, `import mask2former` fails here.
"""
from detectron2.evaluation.coco_evaluation import COCOEvaluator
from detectron2.evaluation.fast_eval_api import COCOeval_opt  # noqa: F401  (the hostile import, kept)


class InstanceSegEvaluator(COCOEvaluator):
    """Upstream's copy of COCOEvaluator relaxes the check that mapped category ids are 0..K-1; the stand-in keeps
    detectron2's evaluation as it is (it is never run by the tests)."""
