"""TESTR's TextVisualizer, as far as reading words goes (adet/utils/visualizer.py): the class its demo draws
predictions with, and whose decoding is the model's own reading of `recs`.

The character table is the 95 printable ASCII characters, or a pickled list of code points named by the config
(upstream: MODEL.BATEXT.CUSTOM_DICT; this stand-in keeps its vocabulary under MODEL.TRANSFORMER, as its head does),
and must hold VOC_SIZE - 1 entries. The "unknown" class (VOC_SIZE - 1) reads '口'; in CTC reading it neither ends
nor starts a run.
"""
import pickle

from detectron2.utils.visualizer import Visualizer

ASCII = [chr(c) for c in range(32, 127)]


class TextVisualizer(Visualizer):
    def __init__(self, image, metadata, instance_mode, cfg):
        Visualizer.__init__(self, image, metadata, instance_mode=instance_mode)
        t = cfg.MODEL.TRANSFORMER
        self.voc_size = t.VOC_SIZE
        custom = t.get("CUSTOM_DICT", "") or (cfg.MODEL.BATEXT.CUSTOM_DICT if "BATEXT" in cfg.MODEL else "")
        if custom:
            with open(custom, "rb") as f:
                self.CTLABELS = pickle.load(f)
        else:
            self.CTLABELS = ASCII
        assert self.voc_size - 1 == len(self.CTLABELS), (
            f"voc_size is not matched dictionary size, got {self.voc_size - 1} and {len(self.CTLABELS)}.")

    def _label(self, c):
        return self.CTLABELS[c] if self.voc_size == 96 else chr(self.CTLABELS[c])

    def _decode_recognition(self, rec):
        text = ""
        for c in map(int, rec):
            if c < self.voc_size - 1:
                text += self._label(c)
            elif c == self.voc_size - 1:
                text += "口"
        return text

    def _ctc_decode_recognition(self, rec):
        text, last = "", None
        for c in map(int, rec):
            if c < self.voc_size - 1:
                if c != last:
                    text += self._label(c)
                    last = c
            elif c == self.voc_size - 1:
                text += "口"  # the run goes on across it
            else:
                last = None
        return text
