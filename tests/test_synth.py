"""Synthetic labelled sets (`d2export synth`): same bytes for the same arguments, labels inside their pictures and on
the drawn ink, loadable by detectron2's loaders and an AdelaiDet-shaped mapper, scored 100 AP against themselves."""
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, ImageDraw

from d2export.charset import charset, decode, encode
from d2export.datasets import draw, generate, register
from d2export.datasets import synth as synth_module
from d2export.datasets.text import ALPHABET, VOCABULARY, sample as text_sample

SIZE = (208, 160)  # not square, not the default


@pytest.fixture(scope="module")
def text_set(tmp_path_factory):
    return generate("text", tmp_path_factory.mktemp("synth") / "text", count=12, seed=3, size=SIZE, workers=1, vis=2)


@pytest.fixture(scope="module")
def box_set(tmp_path_factory):
    return generate("boxes", tmp_path_factory.mktemp("synth") / "boxes", count=12, seed=3, size=SIZE, workers=1)


def files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def coco(folder):
    return json.loads((folder / "annotations.json").read_text())


def test_vocabulary_and_encoding():
    assert len(VOCABULARY) == len(set(VOCABULARY)) > 500
    assert set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") <= set(ALPHABET)
    ids = encode("Ab9~", 96, 25)
    assert ids[:4] == [33, 66, 25, 94] and ids[4:] == [96] * 21  # ord(c) - 32; 96 pads
    assert encode("é", 96, 3) == [95, 96, 96]  # outside the 95 printable characters: "unknown"
    assert decode(encode("Hello 42", 96, 25), charset(96)) == "Hello 42"
    with pytest.raises(ValueError, match="26 characters"):
        encode("x" * 26, 96, 25)


@pytest.mark.parametrize("kind", ["text", "boxes"])
def test_same_arguments_same_bytes_whatever_the_workers(kind, tmp_path, text_set, box_set):
    first = {"text": text_set, "boxes": box_set}[kind]
    again = generate(kind, tmp_path / "again", count=12, seed=3, size=SIZE, workers=2)
    theirs = {k: v for k, v in files(first).items() if not k.startswith("vis/")}
    assert files(again) == theirs
    other = generate(kind, tmp_path / "other", count=2, seed=4, size=SIZE, workers=1)
    assert files(other)["images/000000.jpg"] != theirs["images/000000.jpg"]


def test_unasked_workers_start_a_pool_only_where_the_set_pays_for_it(tmp_path, monkeypatch, box_set):
    """Without --workers, a handful of pictures is drawn in the caller (a pool's processes each import the calling
    script again: seconds); past the threshold a pool of one per core, the same bytes either way."""
    started = []

    class Recording:  # the pool's interface, in this process
        def __init__(self, workers, mp_context=None):
            started.append(workers)

        def map(self, fn, jobs, chunksize=1):
            return map(fn, jobs)

        def shutdown(self, cancel_futures=False):
            pass

    monkeypatch.setattr(synth_module, "ProcessPoolExecutor", Recording)
    monkeypatch.setattr(synth_module.os, "cpu_count", lambda: 2)
    small = generate("boxes", tmp_path / "small", count=12, seed=3, size=SIZE)
    assert started == []
    monkeypatch.setattr(synth_module, "POOL_PAYS_AFTER_S", 0.0)
    pooled = generate("boxes", tmp_path / "pooled", count=12, seed=3, size=SIZE)
    assert started == [2]
    assert files(small) == files(pooled) == files(box_set)


def inside_picture(points, width, height):
    p = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    return bool(((p >= 0) & (p <= [width, height])).all())


def test_every_label_lies_inside_its_picture(text_set, box_set):
    for folder in (text_set, box_set):
        data = coco(folder)
        sizes = {im["id"]: (im["width"], im["height"]) for im in data["images"]}
        assert {im["file_name"] for im in data["images"]} == {p.name for p in (folder / "images").iterdir()}
        assert len(data["annotations"]) >= len(data["images"])
        for a in data["annotations"]:
            w, h = sizes[a["image_id"]]
            x, y, bw, bh = a["bbox"]
            assert bw > 0 and bh > 0 and inside_picture([x, y, x + bw, y + bh], w, h)
            for key in ("bezier_pts", "polys"):
                if key in a:
                    assert inside_picture(a[key], w, h)
            assert all(inside_picture(poly, w, h) for poly in a["segmentation"])
    assert Image.open(next((text_set / "images").iterdir())).size == SIZE


def cubic(ctrl, t):
    """The test's own cubic Bezier: de Casteljau's construction."""
    p = [np.asarray(c, dtype=np.float64) for c in ctrl]
    while len(p) > 1:
        p = [(1 - t) * a + t * b for a, b in zip(p, p[1:])]
    return p[0]


def test_boundary_points_lie_on_the_bezier_curves(text_set):
    for a in coco(text_set)["annotations"]:
        bez = np.asarray(a["bezier_pts"]).reshape(8, 2)
        polys = np.asarray(a["polys"]).reshape(16, 2)
        t = np.linspace(0, 1, 8)
        top = np.array([cubic(bez[:4], s) for s in t])
        bottom = np.array([cubic(bez[4:], s) for s in t])  # upstream order: the bottom runs right to left
        np.testing.assert_allclose(polys, np.concatenate([top, bottom]), atol=0.011)
        assert a["segmentation"] == [a["polys"]] and len(a["rec"]) == 25


def polygon_mask(points, width, height, grow=0):
    img = Image.new("L", (width, height))
    ImageDraw.Draw(img).polygon([tuple(p) for p in np.asarray(points).reshape(-1, 2)], fill=1, outline=1,
                                width=1 + 2 * grow)
    return np.asarray(img, bool)


def rendered(seed, index, width, height):
    """The picture, the same picture drawn without its words, and its labels."""
    from d2export.datasets import text

    with_words, instances = text_sample(synth_module.rng("text", seed, index), width, height)
    bare, _ = text_sample(synth_module.rng("text", seed, index), width, height, draw_text=False)
    labels = [text.annotation(i) for i in instances]
    ink = np.abs(with_words.astype(int) - bare.astype(int)).max(axis=2) > 24
    return ink, labels


def gap(points, polyline):
    """The smallest distance from any of the points (n, 2) to a polyline (m, 2)."""
    a, b = polyline[:-1], polyline[1:]
    ab = b - a
    t = np.clip(((points[:, None] - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-9), 0, 1)
    return float(np.linalg.norm(points[:, None] - (a + t[..., None] * ab), axis=-1).min())


def ink_check(ink, labels, width, height, shift=(0.0, 0.0)):
    """The fraction of ink outside every label polygon, and per label: the share of its polygon the ink fills, the
    largest gap between one of its four sides (top, bottom, left and right end) and the ink inside it, relative to
    its height, and whether it has ink in both halves along the text."""
    within = np.zeros_like(ink)
    report = []
    for a in labels:
        polys = np.asarray(a["polys"]).reshape(16, 2) + shift
        mask = polygon_mask(polys, width, height, grow=1)
        within |= mask
        ys, xs = np.nonzero(ink & mask)
        pts = np.stack([xs + 0.5, ys + 0.5], axis=1)
        sides = (polys[:8], polys[8:], polys[[15, 0]], polys[[7, 8]])
        tall = np.linalg.norm(polys[0] - polys[15])
        left = polygon_mask(np.concatenate([polys[:5], polys[11:]]), width, height)
        right = polygon_mask(np.concatenate([polys[3:8], polys[8:13]]), width, height)
        report.append({"fill": len(pts) / max(polygon_mask(polys, width, height).sum(), 1),
                       "side_gap": max(gap(pts, s) for s in sides) / tall if len(pts) else np.inf,
                       "halves": bool((ink & left).any() and (ink & right).any())})
    return (ink & ~within).sum() / max(ink.sum(), 1), report


def curved(a):
    bez = np.asarray(a["bezier_pts"]).reshape(8, 2)
    chord = bez[3] - bez[0]
    normal = np.array([-chord[1], chord[0]]) / np.linalg.norm(chord)
    return abs((bez[1] - bez[0]) @ normal) > 2


def test_labels_lie_on_the_drawn_ink():
    width, height = 320, 256
    checked = curved_seen = 0
    for index in range(8):
        ink, labels = rendered(11, index, width, height)
        stray, report = ink_check(ink, labels, width, height)
        assert stray < 0.005, f"picture {index}: {stray:.1%} of the ink lies outside every label"
        for a, r in zip(labels, report):
            word = decode(a["rec"], charset(96))
            assert r["fill"] > 0.15, f"picture {index}, {word!r}: its polygon holds little ink ({r['fill']:.0%})"
            assert r["side_gap"] < 0.25, f"picture {index}, {word!r}: a side {r['side_gap']:.0%} of the height off"
            assert r["halves"], f"picture {index}, {word!r}: no ink in one half of the band"
            checked += 1
            curved_seen += curved(a)
    assert checked >= 12 and curved_seen >= 2


def test_the_ink_check_refuses_labels_moved_off_the_text():
    width, height = 320, 256
    ink, labels = rendered(11, 0, width, height)
    stray, report = ink_check(ink, labels, width, height, shift=(6.0, 3.0))
    assert stray > 0.02 or any(r["side_gap"] >= 0.25 for r in report)


def test_text_set_loads_through_detectron2_and_an_adelaidet_mapper(text_set):
    import testr_c_shim

    testr_c_shim.install()
    from detectron2.config import get_cfg
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from testr.data import DatasetMapperWithBasis

    name = register("synth_text_test", text_set)
    try:
        records = DatasetCatalog.get(name)
        assert MetadataCatalog.get(name).thing_classes == ["text"]
        assert MetadataCatalog.get(name).voc_size == 96
        raw = {a["id"]: a for a in coco(text_set)["annotations"]}
        assert len(records) == 12 and sum(len(r["annotations"]) for r in records) == len(raw)
        first = records[0]["annotations"][0]
        source = next(a for a in raw.values() if a["bbox"] == first["bbox"])
        assert first["beziers"] == source["bezier_pts"] and first["polygons"] == source["polys"]
        assert first["rec"] == first["text"] == source["rec"] and first["category_id"] == 0

        cfg = get_cfg()
        cfg.INPUT.MIN_SIZE_TRAIN, cfg.INPUT.MAX_SIZE_TRAIN = (320,), 1000
        record = next(r for r in records if r["annotations"])
        out = DatasetMapperWithBasis(cfg, is_train=True)(record)
        inst = out["instances"]
        scale = 320 / SIZE[1]
        assert tuple(out["image"].shape) == (3, 320, round(SIZE[0] * scale))
        n = len(record["annotations"])
        assert inst.beziers.shape == (n, 16) and inst.polygons.shape == (n, 32) and inst.text.shape == (n, 25)
        np.testing.assert_allclose(inst.beziers.numpy(), np.array([a["beziers"] for a in record["annotations"]])
                                   * scale, rtol=1e-5, atol=1e-3)
        assert inst.text.tolist() == [a["rec"] for a in record["annotations"]]
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


def evaluate_against_itself(folder, name, move=0.0):
    import torch
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from detectron2.evaluation import COCOEvaluator
    from detectron2.structures import Boxes, BoxMode, Instances
    from pycocotools import mask as mask_util

    register(name, folder)
    try:
        evaluator = COCOEvaluator(name, tasks=("bbox", "segm"), distributed=False, output_dir=None)
        evaluator.reset()
        for record in DatasetCatalog.get(name):
            h, w = record["height"], record["width"]
            anns = record["annotations"]
            if not anns:
                continue
            inst = Instances((h, w))
            boxes = np.array([BoxMode.convert(a["bbox"], a["bbox_mode"], BoxMode.XYXY_ABS) for a in anns])
            boxes = boxes.reshape(-1, 4) + np.array([1, 0, 1, 0]) * move * (boxes[:, 2:3] - boxes[:, 0:1])
            inst.pred_boxes = Boxes(torch.as_tensor(boxes, dtype=torch.float32))
            inst.scores = torch.ones(len(anns))
            inst.pred_classes = torch.as_tensor([a["category_id"] for a in anns], dtype=torch.int64)
            masks = [mask_util.decode(mask_util.merge(mask_util.frPyObjects(a["segmentation"], h, w)))
                     for a in anns]
            inst.pred_masks = torch.as_tensor(np.array(masks, dtype=bool).reshape(-1, h, w))
            if move:
                inst.pred_masks = torch.roll(inst.pred_masks, int(move * 40), dims=2)
            evaluator.process([{"image_id": record["image_id"]}], [{"instances": inst}])
        return evaluator.evaluate()
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


def test_box_set_scores_100_ap_against_itself_and_less_when_moved(box_set):
    data = coco(box_set)
    assert {c["name"] for c in data["categories"]} == {"ellipse", "triangle", "rectangle", "star", "cross"}
    assert len({a["category_id"] for a in data["annotations"]}) >= 4
    assert any(len(a["segmentation"]) > 1 for a in data["annotations"]) or \
        any(a["area"] < 0.6 * a["bbox"][2] * a["bbox"][3] for a in data["annotations"])
    perfect = evaluate_against_itself(box_set, "synth_boxes_self")
    assert perfect["bbox"]["AP"] == pytest.approx(100.0) and perfect["segm"]["AP"] == pytest.approx(100.0)
    moved = evaluate_against_itself(box_set, "synth_boxes_moved", move=0.3)
    assert moved["bbox"]["AP"] < 60 and moved["segm"]["AP"] < 60


def test_cli_writes_whole_sets_or_nothing(tmp_path, monkeypatch):
    out = tmp_path / "set"
    cmd = [sys.executable, "-m", "d2export.cli", "synth", "boxes", "--out", str(out), "--count", "3",
           "--size", "96x64", "--vis", "2", "--workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 pictures" in done.stdout
    assert sorted(p.name for p in (out / "vis").iterdir()) == ["000000.jpg", "000001.jpg", "grid.jpg"]
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr
    bad = subprocess.run(cmd[:-6] + ["--size", "64by64"], capture_output=True, text=True)
    assert bad.returncode == 2 and "WIDTHxHEIGHT" in bad.stderr

    def broken(job):
        if job[2] == 2:
            raise RuntimeError("disk on fire")
        return real(job)

    real = synth_module._picture
    monkeypatch.setattr(synth_module, "_picture", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        generate("text", tmp_path / "half", count=4, size=(96, 64), workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no half-written set, no temporary folder
    assert draw("boxes", 0, 0, 96, 64)[0].shape == (64, 96, 3)


def test_drawing_a_set_needs_no_torch():
    code = ("import sys, d2export.datasets as d; d.draw('text', 0, 0, 64, 48); "
            "assert 'torch' not in sys.modules and 'detectron2' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _ink_columns(alpha):
    return np.nonzero((alpha > 0).any(axis=0))[0]


@pytest.mark.parametrize("word", ["mill", "Wall", "C3PO", "queen", "jazz", "24h", "WELCOME"])
def test_glyph_centres_lie_between_the_ink_of_their_neighbours(word):
    """Character i's centre lies past the ink of the first i characters and within the ink of the first i + 1,
    each prefix drawn on its own (its ink starts where the word's does: the same first glyph)."""
    from d2export.datasets.text import flat_word, glyph_centres

    size = 24
    alpha = flat_word(word, size, 0)
    start = _ink_columns(alpha)[0]
    ends = [start]
    for i in range(1, len(word) + 1):
        cols = _ink_columns(flat_word(word[:i], size, 0))
        ends.append(start + cols[-1] - cols[0] + 1)
    assert ends[-1] == _ink_columns(alpha)[-1] + 1
    centres = np.asarray(glyph_centres(word, size)) * alpha.shape[1]
    for i, c in enumerate(centres):
        assert ends[i] - 1 <= c <= ends[i + 1] + 1, (word, i, c, ends)


def test_even_shares_of_a_word_miss_its_glyphs():
    """What glyph_centres replaces: in "mill" the even share of the first character (u = 1/8) lies inside the m's
    ink but far from its centre, and the l's even share (5/8) lies on the i."""
    from d2export.datasets.text import glyph_centres

    centres = glyph_centres("mill")
    assert centres[0] > 0.2 and abs(centres[2] - 0.625) > 0.1
