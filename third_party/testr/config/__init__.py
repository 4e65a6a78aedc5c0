from .config import get_cfg
from .defaults import add_testr_config

__all__ = ["get_cfg", "add_testr_config"]
