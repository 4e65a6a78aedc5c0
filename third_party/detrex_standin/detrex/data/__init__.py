from .detr_dataset_mapper import DetrDatasetMapper

__all__ = ["DetrDatasetMapper"]
