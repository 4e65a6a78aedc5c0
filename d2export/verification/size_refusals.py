"""Whether an eager failure is the model's own refusal of a picture's size (and not d2export's or a tracer's fault):
what the verification sizes and the check below torch.export's minimums both ask."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

# What a model's own code raises when a picture is too small for it (an assert on a level's size, torch's "selected
# index k out of range" from a top-k over too few tokens, a shape mismatch): the kinds, and where they come from.
SIZE_ERRORS = (AssertionError, RuntimeError, ValueError, IndexError)
_NOT_THE_MODEL = (Path(__file__).resolve().parents[1],  # d2export itself
                  *(Path(torch.__file__).resolve().parent / p for p in ("_dynamo", "fx", "export", "_export", "jit",
                                                                        "onnx", "_subclasses")))  # torch's tracers


def _innermost(e: BaseException) -> str:
    """file:line of the innermost Python frame the exception passed through ('?' without a traceback)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def model_size_error(e: BaseException) -> bool:
    """Whether an exception from the eager reference is the model's own refusal of a size: one of SIZE_ERRORS (a
    NotImplementedError is no size limit), raised where the innermost Python frame is the model's code or a library
    it calls (an op raising in C++ counts at its Python caller), not d2export's nor torch's tracing machinery."""
    frames = traceback.extract_tb(e.__traceback__)
    if not isinstance(e, SIZE_ERRORS) or isinstance(e, NotImplementedError) or not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    return not any(where.is_relative_to(p) for p in _NOT_THE_MODEL)
