# DINO's R-50 model with dino_tiny's thin transformer (one encoder and one decoder layer, 128-wide FFNs, 30 queries,
# top-20) and 160-pixel pictures: the base the backbone configs of dino-vitdet, dino-convnext and dino-focalnet swap
# their backbone into.
from omegaconf import OmegaConf

from detrex.config import get_config

from .dino_r50 import model

dataloader = get_config("common/data/coco_detr.py").dataloader
dataloader.test.mapper.augmentation[0].short_edge_length = 160
dataloader.test.mapper.augmentation[0].max_size = 256
train = OmegaConf.create(dict(init_checkpoint="", output_dir="./output/dino_thin", device="cuda"))

model.transformer.encoder.num_layers = 1
model.transformer.decoder.num_layers = 1
model.transformer.encoder.feedforward_dim = 128
model.transformer.decoder.feedforward_dim = 128
model.num_queries = 30
model.select_box_nums_for_evaluation = 20
