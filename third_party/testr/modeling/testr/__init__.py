from .models import TESTR

__all__ = ["TESTR"]
