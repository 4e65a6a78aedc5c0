"""Reduced-precision verification judges each output by its kind: ids equal (a flip only where a tie is possible),
coordinates in pixels, scores by the score tolerance; confident detections get no allowance. Every graph here is made
wrong by hand, in ways the single tolerance 0.05 + 0.05·|x| that float16 once used let through."""
import numpy as np
import pytest

from d2export.verification.comparison import Reduced, compare_reduced_case

BOXES = {"boxes": "pixels", "scores": "probabilities", "labels": "ids"}
TEXT = {"scores": "probabilities", "labels": "ids", "ctrl_points": "pixels", "char_ids": "ids",
        "char_scores": "probabilities"}
FLOAT16 = Reduced("float16", atol=0.05, rtol=0.05, pixel_atol=1.0, pixel_rtol=2e-3, max_mismatch=0.05,
                  confident=0.3, top_k=5, min_agreement=0.8)


def passes(expected, actual, kinds, tol=FLOAT16):
    compared, agreement = compare_reduced_case("case", expected, actual, tol, kinds)
    return all(c.ok for c in compared) and agreement >= tol.min_agreement


def noisy(outputs, rng, pixels=0.3, score=0.01):
    """What float16 does to a right graph's outputs: floats move a little, ids stay."""
    out = {}
    for name, x in outputs.items():
        if x.dtype.kind != "f":
            out[name] = x.copy()
        elif name in ("boxes", "ctrl_points"):
            out[name] = (x + rng.uniform(-pixels, pixels, x.shape)).astype(np.float32)
        else:
            out[name] = np.clip(x + rng.uniform(-score, score, x.shape), 0, 1).astype(np.float32)
    return out


@pytest.fixture
def text():
    """16 detections of 8 characters each (ids 40-82, read with probability 0.9) and 16 control points in a
    640-pixel picture, sorted by score: the first 6 confident."""
    rng = np.random.default_rng(0)
    k, t = 16, 8
    return {"scores": np.sort(np.concatenate([rng.uniform(0.5, 0.95, 6), rng.uniform(0.01, 0.2, k - 6)]))[::-1]
            .astype(np.float32)[None],
            "labels": np.zeros((1, k), np.int64),
            "ctrl_points": rng.uniform(0, 640, (1, k, 16, 2)).astype(np.float32),
            "char_ids": rng.integers(40, 83, (1, k, t)), "char_scores": np.full((1, k, t), 0.9, np.float32)}


@pytest.fixture
def boxes():
    """50 detections of 80 classes in a 640-pixel picture, sorted by score: the first 5 confident, then a tail down to
    a cut at 0.01."""
    rng = np.random.default_rng(1)
    corner = rng.uniform(200, 500, (50, 2))
    scores = np.concatenate([[0.95, 0.9, 0.8, 0.7, 0.6], np.linspace(0.2, 0.01, 45)])
    return {"boxes": np.concatenate([corner, corner + rng.uniform(30, 120, (50, 2))], 1).astype(np.float32)[None],
            "scores": scores.astype(np.float32)[None], "labels": rng.integers(20, 80, (1, 50))}


def test_float16_noise_passes(text, boxes):
    rng = np.random.default_rng(2)
    assert passes(text, noisy(text, rng), TEXT)
    assert passes(boxes, noisy(boxes, rng), BOXES)


def test_every_character_read_one_or_two_off_is_refused(text):
    for off in (1, 2):
        assert not passes(text, text | {"char_ids": text["char_ids"] + off}, TEXT)


def test_a_character_may_flip_only_where_its_probability_allows_a_tie(text):
    flipped = text["char_ids"].copy()
    flipped[0, 0, 3] += 1  # one character of the most confident word
    assert not passes(text, text | {"char_ids": flipped}, TEXT)
    tied = text["char_scores"].copy()
    tied[0, 0, 3] = 0.51  # two characters at about one half each: float16 may pick either
    assert passes(text | {"char_scores": tied}, text | {"char_ids": flipped, "char_scores": tied}, TEXT)


def test_labels_of_twenty_and_more_one_off_are_refused(boxes):
    assert not passes(boxes, boxes | {"labels": boxes["labels"] + 1}, BOXES)


def test_boxes_ten_pixels_off_or_scaled_by_one_percent_are_refused(boxes):
    assert not passes(boxes, boxes | {"boxes": boxes["boxes"] + np.float32(10)}, BOXES)
    assert not passes(boxes, boxes | {"boxes": boxes["boxes"] * np.float32(1.01)}, BOXES)  # 2-6 px at x >= 200


@pytest.mark.parametrize("slot", [0, 4])
def test_one_confident_detection_relabelled_or_moved_five_pixels_is_refused(boxes, slot):
    """One detection of 50 is 2% of the elements, under fp16_max_mismatch = 5%: an allowance that a confident
    detection does not get. The same change to a detection under `confident` is within it."""
    relabelled, moved = boxes["labels"].copy(), boxes["boxes"].copy()
    relabelled[0, slot] += 1
    moved[0, slot] += np.float32(5)
    assert not passes(boxes, boxes | {"labels": relabelled}, BOXES)
    assert not passes(boxes, boxes | {"boxes": moved}, BOXES)
    unsure = 20  # scoring 0.12
    relabelled, moved = boxes["labels"].copy(), boxes["boxes"].copy()
    relabelled[0, unsure] += 1
    moved[0, unsure] += np.float32(5)
    assert passes(boxes, boxes | {"labels": relabelled, "boxes": moved}, BOXES)


def test_a_detection_at_the_cut_may_be_replaced_only_by_one_at_the_cut(boxes):
    """The other half of the cut rule: the graph's list may end with another detection only if that one scores at the
    cut too; a graph detection scoring 0.5 that took the tail's last slot is one eager does not have."""
    elsewhere = np.array([10, 10, 60, 40], np.float32)
    at_cut = {k: v.copy() for k, v in boxes.items()}
    at_cut["boxes"][0, -1], at_cut["labels"][0, -1], at_cut["scores"][0, -1] = elsewhere, 3, 0.0101
    assert passes(boxes, at_cut, BOXES)
    confident = {k: v.copy() for k, v in at_cut.items()}
    confident["scores"][0, -1] = 0.5
    order = np.argsort(-confident["scores"][0], kind="stable")  # the graph's list is sorted by score too
    confident = {k: v[:, order] for k, v in confident.items()}
    assert not passes(boxes, confident, BOXES)


def test_confident_is_a_setting(boxes):
    """With `confident` above every score, one detection moved 5 px is within the 5% allowance again."""
    moved = boxes["boxes"].copy()
    moved[0, 0] += np.float32(5)
    lenient = Reduced("float16", 0.05, 0.05, 1.0, 2e-3, 0.05, confident=1.01)
    assert passes(boxes, boxes | {"boxes": moved}, BOXES, lenient)
