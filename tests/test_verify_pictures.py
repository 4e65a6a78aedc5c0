"""verify.pictures: verification compares on the model's own pictures (a folder or a registered dataset), each
stretched to its case's size in the model's pixel format, instead of synthetic bars and strokes."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from d2export import pipeline
from d2export.config import load

LEFT, RIGHT = (200, 40, 10), (5, 90, 250)  # RGB: each picture's left half and right half


def halves(folder, count: int, height: int = 50, width: int = 70):
    """`count` pictures whose left half is LEFT and right half RIGHT, but for the red of picture i's left (i + 1) * 20:
    any resize keeps the first and last columns, and the red says which picture a case holds."""
    (folder / "images").mkdir(parents=True)
    for i in range(count):
        rgb = np.empty((height, width, 3), np.uint8)
        rgb[:, : width // 2], rgb[:, width // 2:] = LEFT, RIGHT
        rgb[:, : width // 2, 0] = (i + 1) * 20
        Image.fromarray(rgb).save(folder / "images" / f"{i:02d}.png")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = halves(tmp_path_factory.mktemp("pictures"), 3)
    cfg = load("textdet_tiny", [f"export.output_dir={tmp_path_factory.mktemp('out')}", f"verify.pictures={folder}"])
    return pipeline.prepare(cfg)


def test_each_case_holds_the_next_picture_stretched_to_its_size_in_the_models_channel_order(tiny):
    cases = pipeline.verification_cases(tiny)
    sizes = [tuple(s) for s in pipeline.verification_sizes(tiny.cfg)]
    assert len(sizes) > 3 and [tuple(im.shape[1:]) for c in cases[:len(sizes)] for im in c.images] == sizes
    assert tiny.d2cfg.INPUT.FORMAT == "RGB"  # TESTR's configs (BGR: below)
    pictures = [im for c in cases for im in c.images]
    assert len(pictures) == len(sizes) + 2  # the batch case: two more
    for n, im in enumerate(pictures):
        red = ((n % 3) + 1) * 20  # three pictures, taken in turn
        assert im.dtype == np.uint8 and im.shape[0] == 3
        assert im[:, :, 0].T.tolist() == [[red, LEFT[1], LEFT[2]]] * im.shape[1], n
        assert im[:, :, -1].T.tolist() == [list(RIGHT)] * im.shape[1], n
    assert cases[0].name == f"{sizes[0][0]}x{sizes[0][1]} (00.png)" and cases[-1].name.startswith("batch ")
    assert cases[-1].name.endswith("(02.png+00.png)")


def test_a_bgr_model_gets_blue_first(tmp_path):
    from d2export.verification.pictures import picture_at, picture_files

    files = picture_files(str(halves(tmp_path, 2)), 5, "verify.pictures")
    assert [f.name for f in files] == ["00.png", "01.png"]
    im = picture_at(files[1], 33, 91, "BGR")
    assert im.shape == (3, 33, 91) and im.flags.c_contiguous
    assert im[:, 0, 0].tolist() == [LEFT[2], LEFT[1], 40] and im[:, -1, -1].tolist() == list(RIGHT[::-1])


def test_the_eager_references_are_the_models_outputs_on_those_pictures(tiny):
    """What the graph is compared with is eager PyTorch on the folder's pictures, not on synthetic ones."""
    from d2export.tracing import dummy_images

    case = pipeline.verification_cases(tiny)[0]
    for mine, again in zip(case.expected, tiny.adapter.reference(case.images)):
        np.testing.assert_array_equal(mine, again)
    synthetic = tiny.adapter.reference(dummy_images([im.shape[1:] for im in case.images], seed=1000))
    assert any(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(case.expected, synthetic))
    assert load("textdet_tiny", ["export.output_dir=/nonexistent"]).verify.pictures == ""  # synthetic by default


@pytest.mark.parametrize("where, says", [("missing", "neither a folder nor a registered dataset"),
                                         ("empty", "holds no pictures")])
def test_pictures_that_are_not_there_stop_the_export_with_nothing_written(tmp_path, where, says):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    cfg = load("textdet_tiny", [f"export.output_dir={out}", f"verify.pictures={tmp_path / where}",
                                "export.lint=false"])
    with pytest.raises(ValueError, match=f"verify.pictures=.*{says}"):
        pipeline.export(cfg)
    assert not out.exists() or not [p for p in out.rglob("*") if p.suffix in (".onnx", ".json")]
