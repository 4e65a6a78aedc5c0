"""Stand-in for facebookresearch/Mask2Former's `mask2former` package (see third_party/README.md).

Import order is upstream's: `modeling` first (its attention module imports the compiled
`MultiScaleDeformableAttention`), the evaluator last (it imports detectron2's compiled `_C`). Upstream also imports
its dataset mappers and `SemanticSegmentorWithTTA` here; the stand-in has neither.
"""
from . import data  # upstream registers its extra datasets here
from . import modeling

from .config import add_maskformer2_config

from .maskformer_model import MaskFormer

from .evaluation.instance_evaluation import InstanceSegEvaluator
