"""Character sets of text-recognition heads (torch-free: the exporter writes it into the manifest, the runtime
decodes with it).

TESTR-family models (voc_size 96) predict one of the 95 printable ASCII characters (space to '~'), an "unknown"
class (shown as '口', as AdelaiDet does) or, at index voc_size, "no character". Models trained with a custom
dictionary (MODEL.TRANSFORMER.CUSTOM_DICT: a pickled list of code points, e.g. Chinese) use that instead.
"""
from __future__ import annotations

import pickle
from pathlib import Path

UNKNOWN = "口"


def charset(voc_size: int, custom_dict: str = "") -> list[str]:
    """Index → character for the first voc_size classes (the last one "unknown" where the set is ASCII)."""
    if custom_dict:
        with open(Path(custom_dict), "rb") as f:
            codes = pickle.load(f)
        chars = [chr(c) for c in codes]
    else:
        chars = [chr(c) for c in range(32, 127)]
    if len(chars) >= voc_size:
        return chars[:voc_size]
    return chars + [UNKNOWN] * (voc_size - len(chars))


def decode(ids, chars: list[str]) -> str:
    """Per-slot class ids → text: ids ≥ len(chars) mean "no character" and are skipped."""
    return "".join(chars[i] for i in ids if 0 <= i < len(chars))
