"""The text evaluator's counts against hand counts on constructed cases (TotalText's protocol: one-to-one matches
at polygon IoU > 0.5, "###" words don't care, end-to-end equal ignoring case)."""
import numpy as np
import pytest

from d2export.evaluating.text_metrics import Counts, Word, count


def box(x0, y0, x1, y1, text=""):
    return Word(np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], float), text)


WORDS = [box(0, 0, 100, 20, "Hello"), box(0, 50, 60, 70, "world")]


def test_perfect():
    c = count(WORDS, [box(0, 0, 100, 20, "hello"), box(0, 50, 60, 70, "WORLD")])  # case does not count
    assert c == Counts(words=2, detections=2, matched=2, read=2, chars=10)
    s = c.summary()
    assert s["det_hmean"] == s["e2e_hmean"] == s["char_accuracy"] == 100.0


def test_one_missed_word():
    s = count(WORDS, [box(0, 0, 100, 20, "Hello")]).summary()
    assert (s["det_precision"], s["det_recall"]) == (100.0, 50.0)
    assert s["det_hmean"] == pytest.approx(200 / 3)
    assert (s["e2e_precision"], s["e2e_recall"]) == (100.0, 50.0)


def test_one_wrong_transcription():
    c = count(WORDS, [box(0, 0, 100, 20, "Hello"), box(0, 50, 60, 70, "word")])
    assert c == Counts(words=2, detections=2, matched=2, read=1, chars=10, char_errors=1)  # "word" lacks an l
    s = c.summary()
    assert s["det_hmean"] == 100.0 and s["e2e_precision"] == s["e2e_recall"] == 50.0 and s["char_accuracy"] == 90.0


def test_a_split_polygon_matches_nothing():
    # the word found as two halves: each covers half the word (IoU 0.5, not above it)
    c = count(WORDS[:1], [box(0, 0, 50, 20, "Hel"), box(50, 0, 100, 20, "lo")])
    assert c == Counts(words=1, detections=2, matched=0, read=0)


@pytest.mark.parametrize("right, matched", [(51.0, 1), (50.0, 0), (49.0, 0), (50.5, 1)])
def test_iou_just_over_and_under_one_half(right, matched):
    # IoU of [0, right] x [0, 20] with the word [0, 100] x [0, 20] is right / 100
    assert count(WORDS[:1], [box(0, 0, right, 20, "Hello")]).matched == matched


def test_one_detection_matches_one_word_at_most():
    words = [box(0, 0, 100, 20, "a"), box(0, 2, 100, 22, "b")]
    assert count(words, [box(0, 1, 100, 21, "b")]) == Counts(2, 1, 1, 0, 1, 1)  # a tie: the
    # first word takes it
    assert count(words, [box(0, 1.5, 100, 21.5, "b")]) == Counts(2, 1, 1, 1, 1, 0)  # nearer b


def test_dont_care_words_count_for_neither_side():
    words = [box(0, 0, 100, 20, "Hello"), box(200, 0, 300, 20, "###")]
    c = count(words, [box(0, 0, 100, 20, "Hello"), box(205, 0, 295, 20, "xx")])
    assert c == Counts(words=1, detections=1, matched=1, read=1, chars=5)


def test_self_crossing_detections_are_measured_not_dropped():
    bowtie = Word(np.array([[0, 0], [100, 20], [100, 0], [0, 20]], float), "Hello")
    c = count(WORDS[:1], [bowtie])
    assert c.detections == 1 and c.matched == 0  # two triangles: half the word's area, IoU 0.5


def test_counts_add_up_over_pictures():
    total = count(WORDS, [box(0, 0, 100, 20, "Hello")]) + count(WORDS, WORDS)
    assert total == Counts(words=4, detections=3, matched=3, read=3, chars=15)  # Hello; Hello and world
    assert total.summary()["det_recall"] == 75.0


@pytest.mark.parametrize("said, truth, distance", [("", "abc", 3), ("abc", "abc", 0), ("abd", "abc", 1),
                                                   ("ac", "abc", 1), ("abcd", "abc", 1), ("xyzxyz", "ab", 6),
                                                   ("kitten", "sitting", 3)])
def test_edit_distance_by_hand(said, truth, distance):
    from d2export.evaluating.text_metrics import edits

    assert edits(said, truth) == distance == edits(truth, said)


def test_a_misread_word_costs_at_most_its_characters():
    c = count(WORDS[:1], [box(0, 0, 100, 20, "XXXXXXXXXXXX")])  # 12 characters for a word of 5: 5 errors, not 12
    assert (c.chars, c.char_errors, c.summary()["char_accuracy"]) == (5, 5, 0.0)
