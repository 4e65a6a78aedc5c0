from .defaults import add_deepsolo_config, get_cfg

__all__ = ["get_cfg", "add_deepsolo_config"]
