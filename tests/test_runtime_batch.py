"""`d2export batch` on a local Ray: one row per picture, the same rows as `d2export infer`, reruns that skip what is
written, corrupt pictures as error rows, inputs from folders, globs and list files."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from d2export.cli import main
from d2export.resizing import synthetic_image
from d2export.runtime import batch

# (name, height, width): equal sizes share session runs, the others run alone; non-square, portrait, landscape
PICTURES = [("a.jpg", 90, 150), ("b.jpg", 90, 150), ("c.png", 90, 150), ("nested/d.jpg", 90, 150),
            ("nested/e.png", 200, 120), ("f.jpg", 133, 301), ("nested/deeper/g.webp", 64, 64)]


def jpeg(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(synthetic_image(h, w, seed).transpose(1, 2, 0)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_export):
    """A folder of pictures, some corrupt, and `d2export infer`'s lines for it, keyed by absolute path."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, (name, h, w) in enumerate(PICTURES):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(synthetic_image(h, w, seed=i).transpose(1, 2, 0)).save(folder / name)
    (folder / "truncated.jpg").write_bytes(jpeg(120, 160, 9)[:700])
    (folder / "nested" / "text.png").write_text("not a picture")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.txt").write_text("no picture suffix: not listed")
    out = folder.parent / f"{folder.name}.infer.jsonl"
    assert main(["infer", str(tiny_export[2]), str(folder), "-o", str(out), "--threads", "1", "--no-progress"]) == 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return folder, {str(Path(line.pop("file")).resolve()): line for line in lines}


@pytest.fixture(scope="module")
def local_ray():
    import ray

    batch.connect(None, 3)  # 2 actors x 1 thread and decoding: 3 CPUs declared, whatever the cores
    yield
    ray.shutdown()


def output_rows(folder: Path, fmt: str) -> list[dict]:
    """OUTPUT's rows as `infer`'s lines: parquet's instances column holds the JSON text, jsonl nests it."""
    if fmt == "jsonl":
        return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]
    rows = []
    for row in pq.read_table(folder).to_pylist():
        rows.append({"path": row["path"], "error": row["error"]} if row["error"] is not None else
                    {"path": row["path"], "height": row["height"], "width": row["width"],
                     "instances": json.loads(row["instances"])})
    return rows


def assert_same_as_infer(rows: list[dict], expected: dict[str, dict]) -> None:
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)), "a picture was written twice"
    assert sorted(paths) == sorted(expected)
    for row in rows:
        assert {k: v for k, v in row.items() if k != "path"} == expected[row["path"]], row["path"]


def test_list_pictures(corpus, tmp_path, monkeypatch):
    folder, expected = corpus
    everything = sorted(expected)
    assert batch.list_pictures(str(folder)) == everything  # recursive, by suffix, sorted
    monkeypatch.chdir(folder)
    assert batch.list_pictures(".") == everything
    assert batch.list_pictures("*.jpg") == [str(folder / n) for n in ("a.jpg", "b.jpg", "empty.jpg", "f.jpg",
                                                                      "truncated.jpg")]
    assert batch.list_pictures("nested/**/*.png") == [str(folder / "nested" / n) for n in ("e.png", "text.png")]
    assert batch.list_pictures(f"file://{folder}/nested/deeper") == [f"file://{folder}/nested/deeper/g.webp"]
    listing = tmp_path / "pictures.list"
    listing.write_text(f"# a comment\n{folder}/a.jpg\n\nrelative/x.jpg\nfile:///elsewhere/y.png\n")
    assert batch.list_pictures(str(listing)) == [f"{folder}/a.jpg", f"{tmp_path}/relative/x.jpg",
                                                 "file:///elsewhere/y.png"]
    assert batch.list_pictures(str(folder / "a.jpg")) == [str(folder / "a.jpg")]
    with pytest.raises(FileNotFoundError, match="no such file"):
        batch.list_pictures(str(folder / "missing"))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        batch.list_pictures(f"{folder}/*.tiff")


def test_rows_match_infer_and_reruns_skip_what_is_written(tiny_export, corpus, local_ray, tmp_path, capsys):
    folder, expected = corpus
    out = tmp_path / "rows"
    first = sorted(expected)[:3]
    listing = tmp_path / "first.list"
    listing.write_text("\n".join(first) + "\n")
    summary = batch.run(tiny_export[2], str(listing), str(out), actors=1, batch_size=2, rows_per_file=1)
    assert (summary.total, summary.skipped, summary.written) == (3, 0, 3)
    assert_same_as_infer(output_rows(out, "parquet"), {p: expected[p] for p in first})

    cut = sorted(out.glob("*.parquet"))[0]  # as a run killed while writing it would leave it
    redo = pq.read_metadata(cut).num_rows
    cut.write_bytes(cut.read_bytes()[:-20])
    summary = batch.run(tiny_export[2], str(folder), str(out), actors=2, batch_size=4)
    assert f"removing {cut}" in capsys.readouterr().err
    assert (summary.total, summary.skipped, summary.written) == (len(expected), 3 - redo, len(expected) - 3 + redo)
    assert summary.errors == sum("error" in line for line in expected.values()) == 3
    assert_same_as_infer(output_rows(out, "parquet"), expected)

    again = batch.run(tiny_export[2], str(folder), str(out))
    assert (again.skipped, again.written) == (len(expected), 0)


def test_jsonl_from_the_command_line(tiny_export, corpus, local_ray, tmp_path, capsys):
    folder, expected = corpus
    out = tmp_path / "lines"
    assert main(["batch", str(tiny_export[2]), str(folder), str(out), "--format", "jsonl", "--actors", "1",
                 "--threads", "2", "--batch-size", "3", "--rows-per-file", "2"]) == 0
    assert f"{len(expected)} now" in capsys.readouterr().err
    assert len(list(out.glob("*.jsonl"))) > 1
    assert_same_as_infer(output_rows(out, "jsonl"), expected)


def test_decoding_runs_in_tasks_apart_from_the_sessions(tiny_export, local_ray, capsys):
    """Ray fuses consecutive maps of equal resources: decoding must stay a task stage of its own."""
    processing = batch.Processing(batch.load_manifest(tiny_export[2]))
    session = {"providers": ["cpu"], "threads": 1, "score_threshold": None, "min_size": None, "max_size": None}
    ds = batch.dataset(["x.jpg"], None, processing, actors=1, batch_size=2, session=session)
    ds.explain()
    plan = capsys.readouterr().out.split("Physical Plan (Optimized)")[1]
    assert "TaskPoolMapOperator[MapBatches(prepare_pictures)]" in plan
    assert "ActorPoolMapOperator[MapBatches(InferActor)]" in plan


def test_bad_arguments_are_one_line(tiny_export, corpus, local_ray, tmp_path, capsys):
    folder, _ = corpus
    model = str(tiny_export[2])
    for args, message in ((["--threads", "0"], "at least 1"), (["--actors", "3"], "need 3.5 CPUs"),
                          (["--format", "jsonl", "--providers", "nonesuch"], "nonesuch")):
        assert main(["batch", model, str(folder), str(tmp_path / "out"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and err.startswith("d2export batch: error:") and "\n" not in err
    assert main(["batch", model, str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_segmentation_rows_carry_maps(tiny_export, corpus, tmp_path):
    """An actor's rows for a segmentation model (the tiny spotter's runs answered as one's): PNG bytes in Parquet,
    base64 PNG in JSON lines, as `serve` answers; other models' rows keep their five columns. No Ray needed: the actor
    and the JSON lines writer are called as Ray would."""
    from types import SimpleNamespace

    import numpy as np
    import pyarrow as pa
    from test_runtime_maps import decoded, segmentation_prediction

    from d2export.families import Family, get
    from d2export.served_kinds.pixel_maps import read_ids as read_png_map
    from d2export.runtime.predictor import Predictor

    class Segmenter(Family):
        pixel_maps = True

        def prediction(self, outputs, index, input_hw, original_hw, post, threshold):
            return segmentation_prediction(*original_hw)

    assert get("mask2former").pixel_maps and not get(tiny_export[1].family).pixel_maps
    folder, _ = corpus
    paths = [str(folder / "a.jpg"), str(folder / "nested" / "e.png"), str(folder / "empty.jpg")]
    processing = batch.Processing(batch.load_manifest(tiny_export[2]))
    prepared = batch.prepare_pictures({"path": np.array(paths, dtype=object)}, processing)
    actor = batch.InferActor.__new__(batch.InferActor)  # what __init__ makes, without Ray's object store
    actor.predictor = Predictor(tiny_export[2], threads=1)
    actor.maps = False
    assert actor(prepared).schema == batch.row_schema() and batch.row_schema().names == [
        "path", "height", "width", "instances", "error"]
    actor.predictor.prediction = lambda outputs, index, input_hw, original_hw, *a, **k: segmentation_prediction(
        *map(int, original_hw))
    actor.maps = True
    table = actor(prepared)
    assert table.schema == batch.row_schema(maps=True) and table.schema.field("semantic").type == pa.binary()
    pq.write_table(table, tmp_path / "rows.parquet")
    rows = pq.read_table(tmp_path / "rows.parquet").to_pylist()
    for row, (h, w) in zip(rows, [(90, 150), (200, 120)]):
        want = segmentation_prediction(h, w)
        for key in ("semantic", "panoptic"):
            np.testing.assert_array_equal(read_png_map(row[key]), getattr(want, key))
        assert [s["id"] for s in json.loads(row["segments"])] == [1, 2, 3, 700]
    assert rows[2]["error"] and rows[2]["semantic"] is None and rows[2]["segments"] is None

    sink = batch.jsonl_datasink(str(tmp_path / "lines"), 1000)
    written = io.BytesIO()
    sink.write_block_to_file(SimpleNamespace(to_arrow=lambda: table), written)
    lines = [json.loads(line) for line in written.getvalue().decode().splitlines()]
    assert list(lines[0]) == ["path", "height", "width", "instances", "semantic", "panoptic", "segments"]
    assert set(lines[2]) == {"path", "error"}
    for line in lines[:2]:
        want = segmentation_prediction(line["height"], line["width"])
        for key in ("semantic", "panoptic"):
            assert line[key]["shape"] == [line["height"], line["width"]]
            np.testing.assert_array_equal(decoded(line[key]), getattr(want, key))
        assert line["segments"][3]["class_name"] == "car"
