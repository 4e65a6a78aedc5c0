from detectron2.config import get_cfg as _get_d2_cfg

from .defaults import add_testr_config


def get_cfg():
    """A fresh detectron2 config with TESTR's keys added."""
    return add_testr_config(_get_d2_cfg())
