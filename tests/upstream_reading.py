"""DeepSolo's own reading of per-point character ids (its visualizer's `_ctc_decode_recognition`), transcribed
independently of d2export for the tests that hold served words to it: `labels` index → character (a-z then 0-9 for
VOC_SIZE 37, ASCII 32-126 for 96, chr() of a custom dictionary's code points); ids from len(labels) up ("unknown",
"none") read nothing and end a run; a run of one id reads once."""
from __future__ import annotations

LOWER_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
ASCII = "".join(map(chr, range(32, 127)))


def deepsolo_reading(ids, labels=LOWER_ALNUM) -> str:
    text, last = "", None
    for c in ids:
        if c < len(labels):
            if c != last:
                text += labels[c]
            last = c
        else:
            last = None
    return text
