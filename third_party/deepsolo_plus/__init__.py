"""A DeepSolo++-architecture multilingual spotter written for d2export's tests (ViTAE-Transformer/DeepSolo's
`DeepSolo++/`: MLT19, a language head and a recognition head per script), on the DeepSolo stand-in's layers.

What an exporter sees of DeepSolo++, kept: the detection transformer's `inst_language` classifies each query's
script, `ctrl_point_text` is one head per script (vocabularies of their own sizes), `pred_text_logits` is their list
and `pred_lan_logits` picks the head per query; the detector's inference routes each instance's characters through
its language's head; words read with the per-script `char_map/idx2char/<Lang>.json` (1-based, 0 the blank), opened
from where the tools run. Inference only.
"""
from deepsolo_plus import modeling  # noqa: F401  (registers MultilingualSpotter)
