from omegaconf import OmegaConf

from detrex.config import get_config

from ..models.dino_r50 import model

dataloader = get_config("common/data/coco_detr.py").dataloader
train = OmegaConf.create(dict(init_checkpoint="", output_dir="./output/dino_r50_4scale_12ep", device="cuda"))
