# Upstream registers extra datasets here (COCO panoptic with semantic annotations, ADE20K-full, Mapillary, ...).
# The stand-in's configs train on datasets detectron2 registers itself (coco_2017_train_panoptic,
# coco_2017_train, ade20k_sem_seg_train), so there is nothing to register.
