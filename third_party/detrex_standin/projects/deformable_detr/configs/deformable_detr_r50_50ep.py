from omegaconf import OmegaConf

from detrex.config import get_config

from .models.deformable_detr_r50 import model

dataloader = get_config("common/data/coco_detr.py").dataloader
train = OmegaConf.create(dict(init_checkpoint="", output_dir="./output/deformable_detr_r50_50ep", device="cuda"))
