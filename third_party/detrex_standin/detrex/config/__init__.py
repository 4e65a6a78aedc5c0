import os

from detectron2.config import LazyConfig

# As upstream: the package's configs/ folder, which detrex's setup.py links to the checkout's top-level configs/ at
# install time. This stand-in is laid out like a fresh clone (never installed): the link is missing.
_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def get_config(config_path):
    """A config shipped with detrex by its path under detrex/config/configs (e.g. "common/data/coco_detr.py")."""
    path = os.path.join(_CONFIGS, config_path)
    if not os.path.isfile(path):
        raise RuntimeError(f"{config_path} not available in detrex configs!")
    return LazyConfig.load(path)
