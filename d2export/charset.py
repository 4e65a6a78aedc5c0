"""Character sets of text-recognition heads (torch-free: the exporter writes it into the manifest, the runtime
decodes with it).

TESTR-family models (voc_size 96) predict one of the 95 printable ASCII characters (space to '~'), an "unknown"
class (shown as '口', as AdelaiDet does) or, at index voc_size, "no character". 37-symbol models (DeepSolo's
Total-Text and ICDAR ones) read a-z then 0-9, then "unknown". Models trained with a custom dictionary (CUSTOM_DICT:
a pickled list of code points, e.g. Chinese) use that instead.
"""
from __future__ import annotations

import pickle
from pathlib import Path

UNKNOWN = "口"
LOWER_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"


def charset(voc_size: int, custom_dict: str = "") -> list[str]:
    """Index → character for the first voc_size classes (the last one "unknown" where the set is ASCII)."""
    if custom_dict:
        with open(Path(custom_dict), "rb") as f:
            codes = pickle.load(f)
        chars = [chr(c) for c in codes]
    elif voc_size == len(LOWER_ALNUM) + 1:
        chars = list(LOWER_ALNUM)
    else:
        chars = [chr(c) for c in range(32, 127)]
    if len(chars) >= voc_size:
        return chars[:voc_size]
    return chars + [UNKNOWN] * (voc_size - len(chars))


def encode(text: str, voc_size: int, slots: int) -> list[int]:
    """Text → `slots` class ids as AdelaiDet's labels hold it (`rec`): a character's index in charset(voc_size),
    "unknown" (voc_size - 1) for one outside it, then voc_size ("no character") to the end."""
    if len(text) > slots:
        raise ValueError(f"{text!r} has {len(text)} characters; the labels hold {slots}")
    index = {c: i for i, c in enumerate(charset(voc_size)[:voc_size - 1])}
    return [index.get(c, voc_size - 1) for c in text] + [voc_size] * (slots - len(text))


def decode(ids, chars: list[str], ctc: bool = False) -> str:
    """Per-slot class ids → text: ids outside chars mean "no character" and are skipped. With `ctc` (DeepSolo's
    per-point characters) a run of one id reads as one character; a skipped id ends the run."""
    out, last = [], None
    for i in ids:
        known = 0 <= i < len(chars)
        if known and not (ctc and i == last):
            out.append(chars[i])
        last = i if known else None
    return "".join(out)
