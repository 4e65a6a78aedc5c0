"""The segmentation benchmark's latency rows: every runner is handed the batch it names, eager as DefaultPredictor
runs it (the Predictor's resized pixels, the original size asked back)."""
from types import SimpleNamespace

import numpy as np

from benchmarks.segmentation import latency


class _Predictor:
    def __init__(self):
        self.seen = []

    def prepare(self, hwc):
        h, w = hwc.shape[:2]
        return SimpleNamespace(chw=np.zeros((3, h // 2, w // 2), np.uint8))  # a resize: eager must get these pixels

    def predict_batch(self, images):
        self.seen.append(("predict", [im.shape for im in images]))

    def run(self, prepared):
        self.seen.append(("run", [p.chw.shape for p in prepared]))
        return {}

    def postprocess(self, outputs, index, prepared):
        self.seen.append(("post", index))


def test_each_runner_gets_the_batch_and_eager_the_predictors_pixels():
    eager_calls = []
    predictor = _Predictor()
    times = latency(lambda inputs: eager_calls.append(inputs), {"fused": predictor}, size=64, rounds=2, batch=3)
    assert len(times) == 4 and all(len(t) == 2 and min(t) >= 0 for t in times.values())
    assert len(eager_calls) == 3  # a warm-up and two rounds
    for inputs in eager_calls:
        assert [tuple(d["image"].shape) for d in inputs] == [(3, 32, 32)] * 3
        assert all((d["height"], d["width"]) == (64, 64) for d in inputs)
    assert predictor.seen.count(("predict", [(64, 64, 3)] * 3)) == 3
    assert predictor.seen.count(("run", [(3, 32, 32)] * 3)) == 4  # the post-processing's outputs once more
    assert [x for x in predictor.seen if x[0] == "post"] == [("post", i) for i in range(3)] * 3
