"""A segmentation model's pixel maps as PNG (d2export/runtime/maps.py): 8- and 16-bit semantic ids, COCO panoptic's
RGB encoding, base64 JSON; predictions without maps answered as before. `segmentation_prediction` is the fake
segmentation result the serving tests (infer, serve, batch, Triton, --vis) use."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from d2export.instances import Instance, Prediction, Segment, encode_mask
from d2export.runtime.maps import map_pngs, prediction_json
from d2export.served_kinds.panoptic import panoptic_png
from d2export.served_kinds.pixel_maps import read_ids as read_png_map
from d2export.served_kinds.semantic import semantic_png

NAMES = ["person", "car", "sky", "road", "grass"]


def segmentation_prediction(h: int, w: int, top_class: int = 4) -> Prediction:
    """A panoptic picture of `h`x`w`: sky above, road below, grass bottom right (stuff), a person and a car
    (things), the things also as instances with their masks; the semantic map's classes up to `top_class`."""
    semantic = np.full((h, w), 2, np.int32)  # sky
    semantic[h // 2 :] = 3  # road
    semantic[3 * h // 4 :, w // 2 :] = top_class  # grass (or a class id past 255)
    panoptic = np.zeros((h, w), np.int32)  # void where no segment
    panoptic[: h // 2] = 1
    panoptic[h // 2 :] = 2
    person = np.zeros((h, w), bool)
    person[h // 4 : 3 * h // 4, w // 8 : w // 3] = True
    car = np.zeros((h, w), bool)
    car[h // 2 : 7 * h // 8, w // 2 : 7 * w // 8] = True
    panoptic[person], panoptic[car] = 3, 700  # an id past 255: it takes the G channel
    semantic[person], semantic[car] = 0, 1
    segments = [Segment(1, 2, False, "sky"), Segment(2, 3, False, "road"), Segment(3, 0, True, "person"),
                Segment(700, 1, True, "car")]
    instances = [Instance(0.9, 0, "person", mask=encode_mask(person)), Instance(0.8, 1, "car", mask=encode_mask(car))]
    return Prediction(h, w, instances, semantic=semantic, panoptic=panoptic, segments=segments)


def decoded(entry: dict) -> np.ndarray:
    """A map's JSON entry (base64 PNG) → ids, through Pillow as a client reads it."""
    with Image.open(io.BytesIO(base64.b64decode(entry["png_base64"]))) as picture:
        pixels = np.asarray(picture).astype(np.int64)
    if pixels.ndim == 3:
        return pixels[..., 0] + 256 * pixels[..., 1] + 256 * 256 * pixels[..., 2]
    return pixels


@pytest.mark.parametrize("top, mode", [(4, "L"), (255, "L"), (256, "I;16"), (65535, "I;16")])
def test_semantic_png_is_8_or_16_bit(top, mode):
    ids = np.random.default_rng(top).integers(0, top + 1, (33, 47)).astype(np.int32)
    ids[0, 0] = top
    data = semantic_png(ids)
    with Image.open(io.BytesIO(data)) as picture:
        assert picture.mode == mode and picture.size == (47, 33)
    np.testing.assert_array_equal(read_png_map(data), ids)
    with pytest.raises(ValueError, match="16-bit"):
        semantic_png(np.full((2, 2), 1 << 16))


def test_panoptic_png_is_cocos_rgb_encoding():
    ids = np.random.default_rng(0).integers(0, 1 << 24, (21, 38)).astype(np.int32)
    with Image.open(io.BytesIO(panoptic_png(ids))) as picture:
        assert picture.mode == "RGB"
        rgb = np.asarray(picture).astype(np.int64)
    np.testing.assert_array_equal(rgb[..., 0] + 256 * rgb[..., 1] + 256 ** 2 * rgb[..., 2], ids)  # panopticapi's rgb2id
    np.testing.assert_array_equal(read_png_map(panoptic_png(ids)), ids)


def test_prediction_json_carries_maps_and_leaves_others_alone():
    prediction = segmentation_prediction(40, 64, top_class=300)
    d = json.loads(json.dumps(prediction_json(prediction)))
    assert list(d) == ["height", "width", "instances", "semantic", "panoptic", "segments"]
    for key in ("semantic", "panoptic"):
        assert d[key]["shape"] == [40, 64]
        np.testing.assert_array_equal(decoded(d[key]), getattr(prediction, key))
    assert d["segments"][3] == {"id": 700, "category_id": 1, "isthing": True, "class_name": "car"}
    assert set(map_pngs(prediction)) == {"semantic", "panoptic"}
    # a detector's or spotter's prediction: exactly to_dict(), no map keys
    plain = Prediction(10, 20, [Instance(0.5, 1, box=[1.0, 2.0, 3.0, 4.0])])
    assert prediction_json(plain) == plain.to_dict() and map_pngs(plain) == {}


@pytest.mark.parametrize("old, new", [("semantic_png", semantic_png), ("panoptic_png", panoptic_png),
                                      ("read_png_map", read_png_map)])
def test_the_helpers_maps_once_held_import_with_a_deprecation_warning(old, new):
    from d2export.runtime import maps

    with pytest.warns(DeprecationWarning, match=f"maps.{old} is deprecated"):
        assert getattr(maps, old) is new
    with pytest.warns(DeprecationWarning, match="MAPS is deprecated"):
        assert maps.MAPS == ("semantic", "panoptic")
    with pytest.raises(AttributeError):
        maps.no_such_name  # noqa: B018
