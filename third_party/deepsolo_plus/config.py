"""DeepSolo++'s config: DeepSolo's keys plus MODEL.TRANSFORMER.LANGUAGE (script names and per-script vocabularies)."""
from detectron2.config import CfgNode as CN

from deepsolo.config import get_cfg as deepsolo_cfg


def get_cfg():
    cfg = deepsolo_cfg()
    lang = cfg.MODEL.TRANSFORMER.LANGUAGE = CN()
    lang.CLASSES = ["Latin", "Symbols"]
    lang.VOC_SIZES = [["Latin", 12], ["Symbols", 5]]
    return cfg
