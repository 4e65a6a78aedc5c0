"""The precision benchmark's comparison of what a precision serves against float32's: hand-made predictions whose
agreement is known (the references below are counted by hand, not by the functions under test)."""
import numpy as np

from benchmarks.precision import agreement, instances_matched, mean_iou, word_f
from d2export.instances import Instance, Prediction, encode_mask
from d2export.served_kinds.panoptic import Segment


def _words(*words):
    return Prediction(10, 10, [Instance(0.9, 0, text=w) for w in words])


def test_words_agree_as_a_multiset():
    assert word_f(_words("ab", "cd"), _words("cd", "ab")) == 1.0
    assert word_f(_words("ab", "ab"), _words("ab")) == 2 * 1 / 3  # one of two "ab" found, one word served
    assert word_f(_words("ab"), _words("ba")) == 0.0
    assert word_f(_words(), _words()) == 1.0


def test_semantic_maps_mean_iou_over_the_classes_either_holds():
    a = np.zeros((2, 4), int)
    b = a.copy()
    b[0, 0] = 3  # class 0: 7 of 8 shared; class 3: 0 of 1
    assert mean_iou(a, a) == 1.0
    assert abs(mean_iou(a, b) - (7 / 8 + 0) / 2) < 1e-12


def _masked(label, mask):
    return Instance(0.9, label, mask=encode_mask(mask))


def test_instances_match_by_label_and_mask_iou():
    m = np.zeros((4, 4), bool)
    m[:2] = True  # 8 pixels
    half = np.zeros((4, 4), bool)
    half[:1] = True  # 4 of those: IoU 0.5
    quarter = np.zeros((4, 4), bool)
    quarter[0, :2] = True  # IoU 0.25
    ref = Prediction(4, 4, [_masked(1, m), _masked(2, m)])
    assert instances_matched(ref, Prediction(4, 4, [_masked(1, half), _masked(2, quarter)])) == 0.5
    assert instances_matched(ref, Prediction(4, 4, [_masked(2, m), _masked(1, m)])) == 1.0
    assert instances_matched(ref, Prediction(4, 4, [_masked(3, m)])) == 0.0


def test_panoptic_agreement_is_pq_with_float32_as_the_truth():
    ids = np.array([[1, 1, 2, 2]])
    ref = Prediction(1, 4, panoptic=ids, segments=[Segment(1, 5, True), Segment(2, 6, False)], semantic=ids)
    same = agreement([ref], [ref])
    assert same["PQ"] == 100.0 and same["mIoU"] == 100.0
    other = Prediction(1, 4, panoptic=np.array([[1, 1, 1, 2]]), segments=[Segment(1, 5, True), Segment(2, 6, False)],
                       semantic=np.array([[1, 1, 1, 2]]))
    # segment 1: IoU 2/3 (matched); segment 2: IoU 1/2 (not past 0.5): category 5 PQ 2/3, category 6 PQ 0 (FN + FP)
    assert abs(agreement([ref], [other])["PQ"] - 100 * (2 / 3 + 0) / 2) < 1e-9
