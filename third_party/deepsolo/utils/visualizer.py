"""DeepSolo's TextVisualizer, as far as reading words goes (adet/utils/visualizer.py): the class its demo draws
predictions with, and whose CTC decoding is the model's own reading of the per-point `recs`.

The character table follows VOC_SIZE: 96 the printable ASCII characters, 37 a-z then 0-9, any other a pickled list
of code points named by MODEL.TRANSFORMER.CUSTOM_DICT (ReCTS: "chn_cls_list", opened relative to where the tools
run); it must hold VOC_SIZE - 1 entries. Ids from VOC_SIZE - 1 up ("unknown", "none") read nothing and end a run.
"""
import pickle

from detectron2.utils.visualizer import Visualizer

BUILT_IN = {96: [chr(c) for c in range(32, 127)], 37: list("abcdefghijklmnopqrstuvwxyz0123456789")}


class TextVisualizer(Visualizer):
    def __init__(self, image, metadata, instance_mode, cfg):
        Visualizer.__init__(self, image, metadata, instance_mode=instance_mode)
        self.voc_size = cfg.MODEL.TRANSFORMER.VOC_SIZE
        self.use_customer_dictionary = cfg.MODEL.TRANSFORMER.CUSTOM_DICT
        if self.voc_size in BUILT_IN:
            self.CTLABELS = BUILT_IN[self.voc_size]
        else:
            with open(self.use_customer_dictionary, "rb") as f:
                self.CTLABELS = pickle.load(f)
        assert self.voc_size - 1 == len(self.CTLABELS), (
            f"voc_size is not matched dictionary size, got {self.voc_size - 1} and {len(self.CTLABELS)}.")

    def _ctc_decode_recognition(self, rec):
        text, last = "", None
        for c in map(int, rec):
            if c < self.voc_size - 1:
                if c != last:
                    text += self.CTLABELS[c] if self.voc_size in BUILT_IN else chr(self.CTLABELS[c])
                    last = c
            else:
                last = None
        return text
