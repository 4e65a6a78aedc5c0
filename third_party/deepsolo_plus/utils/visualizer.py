"""DeepSolo++'s TextVisualizer, as far as reading words goes: per script, `char_map/idx2char/<Lang>.json` (opened
relative to where the tools run; keys "1".."V", 0 the blank) must hold that script's VOC_SIZE entries; a run of one
id reads once, the blank ends a run."""
import json

from detectron2.utils.visualizer import Visualizer


class TextVisualizer(Visualizer):
    def __init__(self, image, metadata, instance_mode, cfg):
        Visualizer.__init__(self, image, metadata, instance_mode=instance_mode)
        self.language_list = cfg.MODEL.TRANSFORMER.LANGUAGE.CLASSES
        self.char_map = {}
        for language, voc_size in cfg.MODEL.TRANSFORMER.LANGUAGE.VOC_SIZES:
            with open(f"char_map/idx2char/{language}.json") as f:
                idx2char = json.load(f)
            assert len(idx2char) == int(voc_size)
            self.char_map[language] = idx2char

    def _ctc_decode_recognition(self, rec, language):
        text, last = "", None
        for c in map(int, rec):
            if c != 0:
                if c != last:
                    text += self.char_map[language][str(c)]
                    last = c
            else:
                last = None
        return text
