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


def test_interior_point_lies_deep_inside():
    from d2export.runtime.visualize import interior_point

    y, x = np.mgrid[0:200, 0:300]
    ring = ((y - 100) ** 2 + (x - 150) ** 2 < 80 ** 2) & ((y - 100) ** 2 + (x - 150) ** 2 > 50 ** 2)
    ell = np.zeros((200, 300), bool)
    ell[20:180, 20:60] = ell[140:180, 20:280] = True
    for mask in (ring, ell):
        px, py = interior_point(mask)
        assert mask[int(py), int(px)]
        # deep: at least 10 pixels from the region's edge (the ring is 30 wide, the L 40)
        assert mask[((y - py) ** 2 + (x - px) ** 2) <= 10 ** 2].all()
    dot = np.zeros((50, 50), bool)
    dot[7, 9] = True  # thinner than the erosion grid: still found
    assert interior_point(dot) == (9.0, 7.0)
    assert interior_point(np.zeros((5, 5), bool)) is None


@pytest.mark.parametrize("kind", ["panoptic", "semantic"])
def test_segmentation_maps_are_translucent_regions_labelled_once(kind):
    from test_runtime_maps import NAMES, segmentation_prediction

    from d2export.runtime.visualize import _colour

    prediction = segmentation_prediction(240, 320)
    prediction.instances = []  # the regions alone: each label's colour is its region's
    if kind == "semantic":
        prediction.panoptic = prediction.segments = None
        regions = {c: prediction.semantic == c for c in range(5)}
    else:
        regions = {s.id: prediction.panoptic == s.id for s in prediction.segments}
    image = np.full((240, 320, 3), 255, np.uint8)
    picture = np.asarray(draw_prediction(image, prediction, class_names=NAMES))
    for key, mask in regions.items():
        colour = np.array(_colour(key))
        tinted = np.round(0.6 * 255 + 0.4 * colour)
        assert (np.abs(picture[mask].astype(int) - tinted).max(-1) <= 1).mean() > 0.7  # mostly the tint (labels on top)
        label = np.all(picture == colour, axis=-1)  # a label's box is filled with its region's own colour
        ys, xs = np.nonzero(label)
        assert len(ys) > 50, key
        # one label, lying on its region
        assert ys.max() - ys.min() < 40 and mask[int(np.median(ys)), int(np.median(xs))], key
    assert (picture[prediction.panoptic == 0] == 255).all() if kind == "panoptic" else True  # void stays clear
