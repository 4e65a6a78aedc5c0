"""The HTTP server on a loopback port: real requests, good and malformed; it keeps serving; batching joins requests."""
from __future__ import annotations

import io
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from d2export.resizing import synthetic_image
from d2export.runtime.predictor import Predictor
from d2export.runtime.server import create_app, serving

MAX_PIXELS = 100_000
MAX_BYTES = 1_000_000


def encoded(h: int, w: int, seed: int = 0, fmt: str = "PNG") -> tuple[np.ndarray, bytes]:
    from PIL import Image

    image = synthetic_image(h, w, seed).transpose(1, 2, 0).copy()
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, fmt)
    return image, buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG header that declares a size, without the pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def predictor(tiny_export):
    return Predictor(tiny_export[2], threads=1)


@pytest.fixture(scope="module")
def client(predictor):
    with serving(create_app(predictor, max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)) as url:
        assert url.startswith("http://127.0.0.1:")
        with httpx.Client(base_url=url, timeout=30) as c:
            yield c


def instances_close(got: list[dict], want) -> None:
    assert len(got) == len(want.instances) > 0
    for g, w in zip(got, want.instances):
        assert g["score"] == pytest.approx(w.score, abs=1e-6) and g["text"] == w.text
        np.testing.assert_allclose(g["polygon"], w.polygon, atol=0.006)  # JSON rounds to 1/100 px


def test_health_and_metadata(client, tiny_export):
    assert client.get("/healthz").json() == {"status": "ok"}
    meta = client.get("/metadata").json()
    manifest = tiny_export[1]
    assert [t["name"] for t in meta["inputs"]] == ["images", "image_sizes"]
    assert [t["name"] for t in meta["outputs"]] == [t.name for t in manifest.outputs]
    assert meta["sha256"] == manifest.sha256 and meta["providers"] == ["CPUExecutionProvider"]
    assert meta["postprocess"]["charset"] == manifest.postprocess["charset"] and meta["max_pixels"] == MAX_PIXELS


def test_predict_raw_bytes_and_multipart(client, predictor):
    image, png = encoded(150, 230, seed=1)
    want = predictor.predict(image)
    r = client.post("/predict", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["height"], body["width"]) == (150, 230)
    instances_close(body["instances"], want)
    r = client.post("/predict", files={"file": ("picture.png", png, "image/png")})
    assert r.status_code == 200, r.text
    instances_close(r.json()["instances"], want)
    image, jpeg = encoded(90, 300, seed=2, fmt="JPEG")  # JPEG decodes lossily: compare with the decoded pixels
    from d2export.runtime.image_decoding import decode_image

    r = client.post("/predict?score_threshold=0.0", content=jpeg)
    assert r.status_code == 200 and (r.json()["height"], r.json()["width"]) == (90, 300)
    instances_close(r.json()["instances"], predictor.predict(decode_image(jpeg)))
    r = client.post("/predict?score_threshold=1", content=png)
    assert r.status_code == 200 and all(i["score"] >= 1 for i in r.json()["instances"])


def test_bad_requests_get_4xx_and_the_server_keeps_serving(client):
    _, png = encoded(120, 160, seed=3)
    _, big = encoded(400, 400, seed=4)  # 160,000 pixels > MAX_PIXELS
    cases = [
        (b"", 400, "empty"),
        (b"this is not a picture", 400, "not an image"),
        (png[: len(png) // 2], 400, "truncated"),
        (png_declaring(0, 0), 400, "not an image"),
        (png_declaring(50_000, 50_000), 413, "limit"),
        (big, 413, "MP"),
        (os.urandom(MAX_BYTES + 1), 413, "limit"),
    ]
    for data, status, words in cases:
        r = client.post("/predict", content=data)
        assert r.status_code == status, (words, r.text)
        assert words in r.json()["detail"]
        assert client.get("/healthz").status_code == 200
    r = client.post("/predict", content=iter([b"x" * (MAX_BYTES // 2 + 1)] * 2))  # chunked: no content-length
    assert r.status_code == 413 and "exceeds" in r.json()["detail"]
    r = client.post("/predict", files={"note": (None, "no file here")})
    assert r.status_code == 400 and "no file" in r.json()["detail"]
    r = client.post("/predict?score_threshold=high", content=png)
    assert r.status_code == 422
    assert client.get("/nowhere").status_code == 404
    r = client.post("/predict", content=png)  # still answers properly
    assert r.status_code == 200 and len(r.json()["instances"]) > 0


def test_batching_joins_concurrent_requests(predictor):
    """Six clients at once into a server that waits up to 0.5 s for company: fewer session runs than requests, only
    pictures of one size share a run, and every answer is the one the picture gets alone (padding a picture for a
    batch-mate of another size would change it)."""
    sizes = [(100, 180), (140, 120), (100, 180), (140, 120), (100, 180), (140, 120)]
    pictures = [encoded(h, w, seed=10 + i) for i, (h, w) in enumerate(sizes)]
    app = create_app(predictor, max_batch=6, batch_timeout_ms=500)
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        with ThreadPoolExecutor(len(pictures)) as pool:
            responses = list(pool.map(lambda p: c.post("/predict", content=p[1]), pictures))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        for (image, _), r in zip(pictures, responses):
            assert (r.json()["height"], r.json()["width"]) == image.shape[:2]
            instances_close(r.json()["instances"], predictor.predict(image))
        runs = app.state.batcher.batch_sizes
        assert sum(runs.values()) < len(pictures) and max(runs) <= 3  # joined, never across sizes
        assert sum(k * n for k, n in runs.items()) == len(pictures)
        assert c.post("/predict", content=b"junk").status_code == 400  # a bad picture never reaches the batch
        assert c.post("/predict", content=pictures[0][1]).status_code == 200


def test_segmentation_maps_come_as_base64_png(tiny_export, client):
    from test_runtime_maps import decoded, segmentation_prediction

    # a predictor of its own whose runs are answered as a segmentation model's (maps in the original size)
    segmenter = Predictor(tiny_export[2], threads=1)
    segmenter.prediction = lambda outputs, index, input_hw, original_hw, *a, **k: segmentation_prediction(
        *map(int, original_hw), top_class=300)
    _, png = encoded(96, 144, seed=5)
    for max_batch in (1, 2):  # alone, and through the batcher
        with serving(create_app(segmenter, max_batch=max_batch)) as url, httpx.Client(base_url=url, timeout=30) as c:
            body = c.post("/predict", content=png).json()
        want = segmentation_prediction(96, 144, top_class=300)
        assert list(body) == ["height", "width", "instances", "semantic", "panoptic", "segments", "seconds"]
        for key in ("semantic", "panoptic"):
            assert body[key]["shape"] == [96, 144]
            np.testing.assert_array_equal(decoded(body[key]), getattr(want, key))  # 16-bit semantic: a class > 255
        assert body["segments"] == [{"id": s.id, "category_id": s.category_id, "isthing": s.isthing,
                                     "class_name": s.class_name} for s in want.segments]
        assert [i["label"] for i in body["instances"]] == [0, 1]
    # other models' answers have no map keys
    assert set(client.post("/predict", content=png).json()) == {"height", "width", "instances", "seconds"}
