"""Pictures of results: labels inside the picture and apart, outlines even for degenerate shapes, every character
drawn with a glyph (the unknown character '口' too), side-by-side pictures."""
from __future__ import annotations

import numpy as np
import pytest

from d2export.charset import UNKNOWN
from d2export.instances import Instance, Prediction
from d2export.runtime.visualize import _overlap, displayable, draw_prediction, font, place_labels, side_by_side


def _inside(box, width, height):
    return box[0] >= 0 and box[1] >= 0 and box[2] <= width and box[3] <= height


@pytest.mark.parametrize("seed", range(5))
def test_labels_stay_inside_and_apart(seed):
    rng = np.random.default_rng(seed)
    width, height = 320, 240
    anchors, sizes = [], []
    for _ in range(8):  # shapes crowded near the edges and corners, some labels wider than the shape
        x0, y0 = rng.choice([0, width - 30]) + rng.uniform(-10, 10), rng.choice([0, height - 20]) + rng.uniform(-5, 5)
        anchors.append((x0, y0, x0 + 30, y0 + 20))
        sizes.append((float(rng.uniform(30, 110)), 14.0))
    boxes = place_labels(anchors, sizes, width, height)
    assert all(_inside(b, width, height) for b in boxes)
    overlapping = sum(_overlap(a, b) > 0 for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert overlapping == 0  # room enough here for every label


def test_a_label_wider_than_the_picture_is_cut_to_it():
    (box,) = place_labels([(5, 5, 10, 10)], [(500, 14)], 100, 50)
    assert _inside(box, 100, 50)


def _label_pixels(picture, colour):
    return np.argwhere(np.all(np.asarray(picture) == colour, axis=-1))


def test_drawn_labels_lie_inside_the_picture():
    image = np.full((120, 200, 3), 255, np.uint8)
    far_right = Instance(0.9, 0, polygon=[[185, 2], [199, 2], [199, 12], [185, 12]], text="a long word at the edge")
    picture = draw_prediction(image, Prediction(120, 200, [far_right]))
    assert picture.size == (200, 120)
    red = _label_pixels(picture, (242, 36, 36))  # the first instance's colour fills its label
    assert len(red) > 0
    # the whole label (its filled box) is in the picture: it ends at the right edge, not beyond
    assert red[:, 1].max() <= 199 and red[:, 1].min() < 199 - 100


def test_coinciding_points_are_still_outlined():
    image = np.full((100, 100, 3), 255, np.uint8)
    picture = np.asarray(draw_prediction(image, Prediction(100, 100, [Instance(0.5, 0, polygon=[[50, 60]] * 4)]),
                                         show_scores=False))
    assert (picture[52:69, 42:59] != 255).any()  # a marker around (50, 60)


def test_unknown_character_draws_a_glyph():
    face = font(16)
    shown = displayable(f"a{UNKNOWN}b", face)
    assert len(shown) == 3 and shown[0] == "a" and shown[2] == "b"
    missing = face.getmask("\uffff")
    glyph = face.getmask(shown[1])
    assert bytes(glyph) != bytes(missing) or glyph.size != missing.size  # not the font's empty box
    assert any(bytes(glyph))  # and not blank


def test_side_by_side_keeps_both_pictures():
    from PIL import Image

    a, b = Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (40, 20), (0, 0, 255))
    both = np.asarray(side_by_side([a, b], gap=4))
    assert both.shape == (20, 74, 3)
    assert (both[:, :30] == (255, 0, 0)).all() and (both[:, 34:] == (0, 0, 255)).all()


def test_labels_avoid_the_title():
    boxes = place_labels([(0, 0, 20, 10)] * 3, [(40, 12)] * 3, 200, 100, avoid=[(0, 0, 60, 20)])
    assert len(boxes) == 3 and all(_overlap(b, (0, 0, 60, 20)) == 0 for b in boxes)
