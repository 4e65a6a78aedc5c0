"""A model whose own code runs only at some sizes (DeepSolo's ViTAEv2: multiples of 32, its ReductionCell asserts
`N == H * W`) is found out at export, not refused: the default verification sizes it refuses are rounded up to the
least multiple it runs at (said in the log and the manifest), the manifest records that size divisibility, and the
runtime pads every picture up to it, so a picture of any size is served. The stand-in: the tiny DeepSolo on
third_party/deepsolo/modeling/reduction (detectron2's ResNet behind a ReductionCell-style check). Sizes a user gave,
other errors, and a refusal no multiple cures still end the export with the model's own error."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from d2export.patching import compiled_ops

compiled_ops.install(["testr._C", "deepsolo._C"])

OVERRIDES = ["model.imports=[deepsolo,deepsolo.modeling.reduction]",
             "model.d2_config=third_party/deepsolo/configs/tiny_reduction.yaml"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(built, manifest, model path, log text) of the plain export: the tiny config and the backbone, nothing else."""
    from d2export import pipeline
    from d2export.config import load

    out = tmp_path_factory.mktemp("divisible")
    cfg = load("deepsolo_tiny", [f"export.output_dir={out}", *OVERRIDES])
    assert not cfg.verify.sizes and cfg.export.dummy_sizes == [[160, 224]]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("d2export").addHandler(handler)
    try:
        built = pipeline.prepare(cfg)
        manifest = pipeline.export(cfg, built=built)
    finally:
        logging.getLogger("d2export").removeHandler(handler)
    return built, manifest, out / manifest.model_file, "\n".join(records)


def test_the_plain_export_finds_the_models_divisibility_and_says_it(exported):
    built, manifest, _, log = exported
    assert manifest.preprocess["size_divisibility"] == 32
    v = manifest.verification
    assert v["passed"] is True
    # 173x217 (the odd size) is refused in the model's own code; at multiples of 8 and 16 (176x224) too
    chosen = [[160, 224], [224, 160], [128, 288], [288, 128], [192, 224]]
    record = v["sizes_chosen"]
    assert record["size_divisibility"] == 32 and record["sizes"] == chosen
    assert record["defaults"][-1] == [173, 217]
    assert "refuses 173x217" in record["why"] and "assert N == H * W" in record["why"]
    assert {c["case"] for c in v["cases"]} == {f"{h}x{w}" for h, w in chosen} | {"batch 160x224+128x288"}
    assert "verification sizes 160x224, 224x160, 128x288, 288x128, 192x224, not" in log
    assert v["served_text"]["checked"] is True  # the served words, at the chosen sizes


@torch.no_grad()
def test_a_picture_of_any_size_is_served_padded_as_the_model_pads_it(exported):
    """333x313 (the size upstream's ViTAEv2 refuses): the runtime pads it to 352x320 (zeros bottom/right, its own size
    in image_sizes), and what is served equals the model's own forward on that padded picture (detectron2's ImageList
    with size_divisibility 32), while the model refuses the picture unpadded."""
    from detectron2.structures import ImageList

    from d2export.resizing import synthetic_image
    from d2export.runtime.predictor import Predictor

    built, _, path, _ = exported
    predictor = Predictor(path, threads=1, min_size=0, max_size=0)  # no resize: the picture's own size in the graph
    image = synthetic_image(333, 313, seed=7).transpose(1, 2, 0).copy()
    feeds = predictor.feeds([predictor.prepare(image)])
    assert feeds["images"].shape == (1, 3, 352, 320) and feeds["image_sizes"].tolist() == [[333, 313]]
    assert not feeds["images"][0, :, 333:].any() and not feeds["images"][0, :, :, 313:].any()
    served = predictor.predict(image).instances

    model = built.model.eval()
    chw = torch.from_numpy(image.transpose(2, 0, 1).astype(np.float32))  # the config's input format is RGB
    inputs = [{"image": chw, "height": 333, "width": 313}]
    with pytest.raises(AssertionError):
        model(inputs)
    own_preprocess = model.preprocess_image
    model.preprocess_image = lambda batch: ImageList.from_tensors([model.normalizer(x["image"]) for x in batch], 32)
    try:
        own = model(inputs)[0]["instances"]
    finally:
        model.preprocess_image = own_preprocess
    assert len(served) == len(own) == 10
    np.testing.assert_allclose([i.score for i in served], own.scores.double(), atol=1e-5, rtol=1e-4)
    assert [i.label for i in served] == own.pred_classes.tolist()
    np.testing.assert_allclose(np.array([np.ravel(i.polygon) for i in served]), own.ctrl_points.double(),
                               atol=5e-3, rtol=1e-4)


def test_sizes_the_user_gives_are_verified_as_given(exported, monkeypatch):
    from d2export.verification import cases

    built = exported[0]
    monkeypatch.setattr(built.cfg.verify, "sizes", [[173, 217]])
    with pytest.raises(AssertionError) as e:
        cases.verification_cases(built)
    assert e.traceback[-1].path.name == "__init__.py" and "reduction" in str(e.traceback[-1].path)


def test_other_failures_and_refusals_no_multiple_cures_end_the_export(exported, monkeypatch):
    from deepsolo.modeling import reduction

    from d2export.verification import cases

    built = exported[0]

    def not_a_size_error(x, ratio):
        if x.shape[-2] % ratio or x.shape[-1] % ratio:
            raise TypeError("the tokeniser takes no odd picture")

    monkeypatch.setattr(reduction, "reduction_cell", not_a_size_error)
    with pytest.raises(TypeError, match="the tokeniser takes no odd picture"):
        cases.verification_cases(built)

    def refuses_every_size(x, ratio):
        assert x.shape[-1] < 0, "no size"

    monkeypatch.setattr(reduction, "reduction_cell", refuses_every_size)
    with pytest.raises(AssertionError, match="no size"):
        cases.verification_cases(built)


def test_padding_to_the_divisibility_fits_with_the_least_size():
    from d2export.resizing import pad_batch

    images = [np.full((3, 40, 50), 9, np.uint8), np.full((3, 70, 20), 9, np.uint8)]
    batch, sizes = pad_batch(images, minimum=(97, 65), divisibility=32)
    assert batch.shape == (2, 3, 128, 96) and sizes.tolist() == [[40, 50], [70, 20]]
    assert not batch[0, :, 40:].any() and not batch[1, :, :, 20:].any()
    assert pad_batch(images, divisibility=32)[0].shape == (2, 3, 96, 64)
    assert pad_batch(images)[0].shape == (2, 3, 70, 50)
