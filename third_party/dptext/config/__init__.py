from .defaults import add_dptext_config, get_cfg

__all__ = ["get_cfg", "add_dptext_config"]
