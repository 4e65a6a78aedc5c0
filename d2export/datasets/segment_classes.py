"""The classes of `d2export synth boxes --segmentation` named in detectron2's MetadataCatalog as NAME when this module
is imported: a segmenter trained on those sets reads its things and stuff from `DATASETS.TRAIN[0]`'s metadata, as
Mask2Former does, so its config names NAME there and imports this module (`model.imports`) before it is built."""
from __future__ import annotations

from d2export.datasets.boxes import PANOPTIC_CATEGORIES
from d2export.datasets.catalog import panoptic_metadata

NAME = "d2export_synth_segments"


def name_classes() -> str:
    """NAME's metadata: the synthetic sets' things then stuff, in the contiguous ids `register()` gives them."""
    from detectron2.data import MetadataCatalog

    meta = MetadataCatalog.get(NAME)
    if not hasattr(meta, "thing_classes"):  # detectron2 refuses to set a key twice
        meta.set(**panoptic_metadata(PANOPTIC_CATEGORIES))
    return NAME


name_classes()
