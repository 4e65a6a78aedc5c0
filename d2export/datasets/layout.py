"""What a synthetic set's folder holds: its files' names and the label of void pixels (the drawers, the writer
and the catalog all read them from here)."""
ANNOTATIONS = "annotations.json"
IMAGES = "images"
SEMANTIC = "semantic"  # per picture a PNG: each pixel's contiguous class, IGNORE_LABEL void
IGNORE_LABEL = 255  # as detectron2's and Mask2Former's COCO semantic maps have it
PANOPTIC = "panoptic"  # per picture a PNG: each pixel's segment id as R + 256·G + 256²·B, 0 void (COCO panoptic)
PANOPTIC_JSON = "panoptic.json"  # COCO panoptic: each picture's segments_info, the categories with isthing
