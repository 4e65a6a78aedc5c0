"""The model's character set, read every way the zoos name it (d2export/charset.py, TextSpotter.text_charset).

References are transcribed from the models' own visualizers (DeepSolo's adet/utils/visualizer.py: a pickled list of
code points read with chr(), ids below VOC_SIZE - 1 read, a run of one id once; DeepSolo++'s idx2char JSON: 1-based,
0 the blank; TESTR's: the unknown class reads '口'), not from the code under test.
"""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from d2export import families
from d2export.charset import CharsetError, decode, read_file, resolve
from d2export.patching import compiled_ops
from upstream_reading import deepsolo_reading

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "third_party"))
compiled_ops.install(["testr._C", "deepsolo._C"])  # the stand-ins import their compiled op, as upstream's do

CHINESE = [0x4E2D, 0x6587, 0x5B57, 0x7B26, 0x8BC6, 0x522B]  # 中文字符识别


def deepsolo_cfg(voc_size: int, transformer_dict: str = "", batext_dict: str = ""):
    from deepsolo.config import get_cfg

    cfg = get_cfg()
    cfg.MODEL.TRANSFORMER.VOC_SIZE = voc_size
    cfg.MODEL.TRANSFORMER.CUSTOM_DICT = transformer_dict
    cfg.MODEL.BATEXT.CUSTOM_DICT = batext_dict
    return cfg


def test_file_forms(tmp_path):
    forms = {
        "codes.pkl": pickle.dumps(CHINESE),
        "strings.pkl": pickle.dumps([chr(c) for c in CHINESE]),
        "list.json": json.dumps([chr(c) for c in CHINESE]).encode(),
        "lines.txt": "\n".join(chr(c) for c in CHINESE).encode() + b"\n",
    }
    for name, data in forms.items():
        (tmp_path / name).write_bytes(data)
        assert read_file(tmp_path / name) == [chr(c) for c in CHINESE], name
    # DeepSolo++'s idx2char: keys "1".., index 0 the blank
    (tmp_path / "Latin.json").write_text(json.dumps({"1": "E", "2": "A", "3": "x\u0313", "4": " "}))
    assert read_file(tmp_path / "Latin.json") == ["", "E", "A", "x\u0313", " "]
    (tmp_path / "gap.json").write_text(json.dumps({"1": "E", "3": "A"}))
    with pytest.raises(CharsetError, match="not consecutive"):
        read_file(tmp_path / "gap.json")


def test_a_blank_entry_reads_nothing_and_separates_runs():
    chars = ["", "a", "b"]  # DeepSolo++: id 0 the blank
    assert decode([1, 1, 0, 1, 2, 2, 0, 0], chars, ctc=True) == "aab"
    assert decode([1, 1, 0, 1], chars, ctc=False) == "aaa"


def test_deepsolo_rects_names_its_dictionary_under_transformer(tmp_path, monkeypatch):
    """configs/R_50/ReCTS/finetune.yaml: MODEL.TRANSFORMER.CUSTOM_DICT "chn_cls_list", relative to the clone's root
    (DeepSolo's tools run from there); found from another working directory through the config's folders above."""
    clone = tmp_path / "DeepSolo"
    (clone / "configs" / "R_50" / "ReCTS").mkdir(parents=True)
    (clone / "chn_cls_list").write_bytes(pickle.dumps(CHINESE))
    monkeypatch.chdir(tmp_path)
    cfg = deepsolo_cfg(len(CHINESE) + 1, transformer_dict="chn_cls_list")
    family = families.get("deepsolo")
    found = family.text_charset(cfg, None, list((clone / "configs" / "R_50" / "ReCTS").parents))
    assert found["charset"] == "中文字符识别"
    assert "MODEL.TRANSFORMER.CUSTOM_DICT=chn_cls_list" in found["charset_source"]
    assert len(found["charset_sha256"]) == 64
    rng = np.random.default_rng(7)
    for _ in range(30):
        ids = rng.integers(0, len(CHINESE) + 2, 25).tolist()
        assert decode(ids, list(found["charset"]), ctc=True) == deepsolo_reading(ids, [chr(c) for c in CHINESE])
    # the older key still works where the new one is empty; the new one wins where both are set
    monkeypatch.chdir(clone)
    (clone / "other").write_bytes(pickle.dumps(CHINESE[::-1]))
    assert family.text_charset(deepsolo_cfg(7, batext_dict="other"))["charset"] == "别识符字文中"
    assert family.text_charset(deepsolo_cfg(7, "chn_cls_list", "other"))["charset"] == "中文字符识别"


def test_wrong_or_missing_dictionaries_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chn_cls_list").write_bytes(pickle.dumps(CHINESE))
    family = families.get("deepsolo")
    with pytest.raises(CharsetError, match=r"holds 6 characters; the head's VOC_SIZE 5462 reads 5461"):
        family.text_charset(deepsolo_cfg(5462, "chn_cls_list"))
    with pytest.raises(CharsetError, match=r"VOC_SIZE 5462 has no built-in character set .*model.charset=FILE"):
        family.text_charset(deepsolo_cfg(5462))  # never an ASCII set padded to the vocabulary
    with pytest.raises(CharsetError, match="missing_list: no such file"):
        family.text_charset(deepsolo_cfg(7, "missing_list"))


def test_model_charset_overrides_and_testr_reads_unknown_as_its_visualizer_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.json").write_text(json.dumps(list("abcdef")))
    found = families.get("deepsolo").text_charset(deepsolo_cfg(7), str(tmp_path / "mine.json"))
    assert found["charset"] == "abcdef" and found["charset_source"].startswith("model.charset=")
    from testr.config import get_cfg

    cfg = get_cfg()
    testr = families.get("testr").text_charset(cfg)
    assert testr["charset"] == "".join(map(chr, range(32, 127))) + "口"  # TESTR: id 95 reads '口', 96 nothing
    assert families.get("dptext").text_charset(cfg) == {}


def test_multi_code_point_entries_reach_the_manifest_as_a_list(tmp_path):
    (tmp_path / "map.json").write_text(json.dumps(["x\u0313", "a", "3"]))
    found = resolve(4, [("MODEL.TRANSFORMER.CUSTOM_DICT", str(tmp_path / "map.json"))]).manifest()
    assert found["charset"] == ["x\u0313", "a", "3"]
    assert decode([0, 0, 4, 0, 1, 2], found["charset"], ctc=True) == "x\u0313x\u0313a3"


def test_a_table_only_the_models_own_code_holds_is_read_from_its_visualizer(tmp_path, monkeypatch):
    """MapTextPipeline's 148 symbols live only in its visualizer (CTLABELS for VOC_SIZE 148): read from there, in
    its order, where the config names no dictionary; without a model the export is refused as before."""
    package = tmp_path / "mapstand"
    (package / "utils").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "utils" / "__init__.py").write_text("")
    (package / "utils" / "visualizer.py").write_text(
        "from detectron2.utils.visualizer import Visualizer\n"
        "class TextVisualizer(Visualizer):\n"
        "    def __init__(self, image, metadata, instance_mode, cfg):\n"
        "        Visualizer.__init__(self, image, metadata, instance_mode=instance_mode)\n"
        "        self.voc_size = cfg.MODEL.TRANSFORMER.VOC_SIZE\n"
        "        if self.voc_size == 6:\n"
        "            self.CTLABELS = [' ', '3', 'x', '\\u0313', 'r']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = type("TransformerPureDetector", (), {"__module__": "mapstand.modeling.text_spotter"})()
    found = families.get("deepsolo").text_charset(deepsolo_cfg(6), None, (), model)
    assert found["charset"] == [" ", "3", "x", "\u0313", "r"] or found["charset"] == " 3x\u0313r"
    assert "mapstand.utils.visualizer.TextVisualizer.CTLABELS" in found["charset_source"]
    with pytest.raises(CharsetError, match="no built-in character set"):
        families.get("deepsolo").text_charset(deepsolo_cfg(6))
    with pytest.raises(CharsetError, match="no built-in character set"):  # a table of another length is no answer
        families.get("deepsolo").text_charset(deepsolo_cfg(7), None, (), model)
