"""Training data, as AdelaiDet's `adet/data` has it: the mapper that turns a text set's records into model inputs."""
from testr.data.dataset_mapper import DatasetMapperWithBasis  # noqa: F401
