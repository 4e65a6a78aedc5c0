"""Small helpers of the AdelaiDet code base; upstream's file is TESTR's unchanged (the testr stand-in's)."""
from testr.utils.misc import (NestedTensor, inverse_sigmoid, inverse_sigmoid_offset,  # noqa: F401
                              nested_tensor_from_tensor_list, sigmoid_offset)
