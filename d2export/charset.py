"""Character sets of text-recognition heads (torch-free: the exporter writes it into the manifest, the runtime
decodes with it).

A head predicts, per slot or point, one of `voc_size - 1` characters, an "unknown" class (voc_size - 1) or "no
character" (voc_size). Which characters those are is the model's own: TESTR-family models with voc_size 96 read the
95 printable ASCII characters (space to '~'), 37-symbol ones (DeepSolo's Total-Text and ICDAR models) a-z then 0-9;
every other model names a dictionary file in its config — DeepSolo under MODEL.TRANSFORMER.CUSTOM_DICT (as its
visualizer and evaluator read it), AdelaiDet's older heads under MODEL.BATEXT.CUSTOM_DICT — or the user gives one
(`model.charset=FILE`). A dictionary of the wrong length is an error, never padded: a padded guess serves wrong words.

Dictionary files, told apart by content: a pickled list of code points or strings (AdelaiDet's `chn_cls_list`), a
JSON list, a JSON map of index → character (DeepSolo++'s `idx2char/*.json`: 1-based, index 0 the blank), or UTF-8
text with one character per line. An entry may be several code points (a letter with a combining mark); an empty
entry is a blank (reads as nothing, separates CTC runs).
"""
from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

UNKNOWN = "口"
LOWER_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
PRINTABLE_ASCII = "".join(map(chr, range(32, 127)))
BUILT_IN = {len(PRINTABLE_ASCII) + 1: PRINTABLE_ASCII, len(LOWER_ALNUM) + 1: LOWER_ALNUM}  # voc_size → characters


class CharsetError(ValueError):
    """The model's character set cannot be read as its config names it (said in one line)."""


class NoCharset(CharsetError):
    """The config names no dictionary and VOC_SIZE has no built-in set (the model's own code may hold its table)."""


@dataclass(frozen=True)
class Charset:
    chars: tuple[str, ...]  # index → what the id reads as ("" for a blank)
    source: str  # where it came from, for the manifest

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(list(self.chars), ensure_ascii=False).encode()).hexdigest()

    def manifest(self) -> dict:
        """The manifest's fields: one string where every entry is one code point (what older runtimes read), else
        the list."""
        simple = all(len(c) == 1 for c in self.chars)
        return {"charset": "".join(self.chars) if simple else list(self.chars), "charset_source": self.source,
                "charset_sha256": self.sha256}


def read_file(path: Path) -> list[str]:
    """A dictionary file's entries, index order (see the module's docstring for the forms)."""
    data = Path(path).read_bytes()
    try:
        loaded = pickle.loads(data)  # noqa: S301 - the user's own model file, as the model's own tools load it
    except Exception:  # noqa: BLE001 - not a pickle: JSON or text below
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CharsetError(f"{path}: neither a pickle, JSON nor UTF-8 text") from None
        try:
            loaded = json.loads(text)
        except ValueError:
            return [line for line in text.splitlines() if line != ""]
    if isinstance(loaded, dict):
        try:
            index = {int(k): v for k, v in loaded.items()}
        except ValueError:
            raise CharsetError(f"{path}: a JSON map whose keys are not indexes") from None
        if min(index, default=0) < 0 or len(index) != max(index, default=-1) + 1 - min(index, default=0):
            raise CharsetError(f"{path}: the map's indexes are not consecutive")
        loaded = [""] * min(index, default=0) + [index[k] for k in sorted(index)]  # 1-based: index 0 the blank
    if not isinstance(loaded, (list, tuple)):
        raise CharsetError(f"{path}: holds a {type(loaded).__name__}, not a list of characters")
    return [chr(c) if isinstance(c, int) else str(c) for c in loaded]


def locate(value: str, search: list[Path]) -> Path:
    """A dictionary path as the model's own tools open it (relative to the working directory, where its scripts run
    from the clone's root), else relative to each of `search` (the folders on model.sys_path, the model config's
    folder and those above it)."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        if not path.exists():
            raise CharsetError(f"{value}: no such file")
        return path.resolve()
    found = next((base / path for base in search if (base / path).is_file()), None)
    if found is None:
        raise CharsetError(f"{value}: no such file in the working directory or {', '.join(map(str, search))}")
    return found.resolve()


def resolve(voc_size: int, named: list[tuple[str, str]], override: str | None = None,
            search: list[Path] | None = None, built_in_first: bool = False) -> Charset:
    """The `voc_size - 1` characters a head reads: `override` (model.charset) first, else the first non-empty
    (config key, value) in `named`, else the built-in set for voc_size (`built_in_first`: before the config's
    dictionary, as DeepSolo's tools choose); a length that disagrees is an error."""
    search = search or []
    key, value = ("model.charset", override) if override else next(((k, v) for k, v in named if v), (None, None))
    if value is None or (built_in_first and not override and voc_size in BUILT_IN):
        if voc_size not in BUILT_IN:
            keys = " / ".join(k for k, _ in named) or "a dictionary key"
            raise NoCharset(f"VOC_SIZE {voc_size} has no built-in character set and the config names no "
                               f"dictionary ({keys}): give the model's own with model.charset=FILE")
        chars = list(BUILT_IN[voc_size])
        return Charset(tuple(chars), f"built-in for VOC_SIZE {voc_size}: {len(chars)} characters")
    path = locate(value, search)
    chars = read_file(path)
    if len(chars) != voc_size - 1:
        raise CharsetError(f"{key}={value} ({path}) holds {len(chars)} characters; the head's VOC_SIZE {voc_size} "
                           f"reads {voc_size - 1} (its last class is 'unknown')")
    return Charset(tuple(chars), f"{key}={value} ({path})")


def charset(voc_size: int) -> list[str]:
    """Index → character for the first voc_size classes of a built-in set, "unknown" last (for training and
    synthetic labels: the models trained here use built-in sets)."""
    if voc_size not in BUILT_IN:
        raise CharsetError(f"VOC_SIZE {voc_size} has no built-in character set")
    return list(BUILT_IN[voc_size]) + [UNKNOWN]


def encode(text: str, voc_size: int, slots: int) -> list[int]:
    """Text → `slots` class ids as AdelaiDet's labels hold it (`rec`): a character's index in charset(voc_size),
    "unknown" (voc_size - 1) for one outside it, then voc_size ("no character") to the end."""
    if len(text) > slots:
        raise ValueError(f"{text!r} has {len(text)} characters; the labels hold {slots}")
    index = {c: i for i, c in enumerate(charset(voc_size)[:voc_size - 1])}
    return [index.get(c, voc_size - 1) for c in text] + [voc_size] * (slots - len(text))


def decode(ids, chars: list[str], ctc: bool = False, unknown: int | None = None) -> str:
    """Per-slot class ids → text: ids outside chars, or a blank entry (""), mean "no character" and are skipped.
    With `ctc` (DeepSolo's per-point characters) a run of one id reads as one character; a skipped id ends the run.
    `unknown`: an id that always reads as its entry and neither ends nor starts a run (TESTR's '口')."""
    out, last = [], None
    for i in ids:
        if i == unknown and 0 <= i < len(chars):
            out.append(chars[i])
            continue
        known = 0 <= i < len(chars) and chars[i] != ""
        if known and not (ctc and i == last):
            out.append(chars[i])
        last = i if known else None
    return "".join(out)
