"""An instance's language (`Instance.language`): the script a multilingual spotter (DeepSolo++) read its text in, one
of the manifest's `languages`; a string in each instance's JSON. Not drawn, not compared (its text is), and not in
detectron2's `Instances` (its own inference keeps the index, `languages`)."""
from __future__ import annotations

from d2export.served_kinds.declaration import ServedKind

LANGUAGE = ServedKind("language", "instance", "str | None",
                      "the script its text was read in (multilingual spotters: DeepSolo++)", after="text_score")

KINDS = (LANGUAGE,)
