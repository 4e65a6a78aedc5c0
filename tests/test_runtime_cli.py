"""`d2export infer` and `d2export triton-repo` from the command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from d2export.cli import main
from d2export.resizing import synthetic_image

REPO = Path(__file__).resolve().parent.parent


def test_infer_writes_json_lines_and_pictures(tiny_export, tmp_path):
    folder = tmp_path / "pictures"
    (folder / "nested").mkdir(parents=True)
    sizes = {"a.png": (130, 210), "nested/b.jpg": (200, 120)}
    for name, (h, w) in sizes.items():
        Image.fromarray(synthetic_image(h, w, seed=len(name)).transpose(1, 2, 0)).save(folder / name)
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    (folder / "notes.txt").write_text("ignored: not a picture suffix")
    out, vis = tmp_path / "out.jsonl", tmp_path / "vis"
    rc = main(["infer", str(tiny_export[2]), str(folder), "-o", str(out), "--vis", str(vis), "--threads", "1",
               "--no-progress"])
    assert rc == 1  # one picture could not be read
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(r["file"]).name for r in lines] == ["a.png", "broken.png", "b.jpg"]
    assert "error" in lines[1] and "instances" not in lines[1]
    for record, (h, w) in zip([lines[0], lines[2]], sizes.values()):
        assert (record["height"], record["width"]) == (h, w)
        inst = record["instances"][0]
        assert set(inst) == {"score", "label", "polygon", "text", "text_score"}
        assert len(inst["polygon"]) == 16 and all(len(p) == 2 for p in inst["polygon"])
    for name, (h, w) in sizes.items():
        with Image.open(vis / f"{Path(name).stem}.png") as pic, Image.open(folder / name) as original:
            assert pic.size == (w, h)  # drawn on the original picture, not the resized input
            assert not np.array_equal(np.asarray(pic.convert("RGB")), np.asarray(original.convert("RGB")))
    assert not (vis / "broken.png").exists()


def test_infer_single_file_to_stdout_and_tool_script(tiny_export, tmp_path):
    picture = tmp_path / "one.png"
    Image.fromarray(synthetic_image(100, 140, seed=5).transpose(1, 2, 0)).save(picture)
    done = subprocess.run([sys.executable, str(REPO / "tools" / "infer.py"), str(tiny_export[2]), str(picture),
                           "--threads", "1", "--score-threshold", "0"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert record["file"] == str(picture)
    assert len(record["instances"]) == 10  # tiny.yaml: NUM_QUERIES 10, and threshold 0 keeps them all


def test_cli_errors_are_one_line(tiny_export, tmp_path, capsys):
    assert main(["infer", str(tiny_export[2]), str(tmp_path / "missing.png")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["infer", str(tiny_export[2]), str(tmp_path), "--providers", "nonesuch"]) == 2
    assert "nonesuch" in capsys.readouterr().err
    assert main(["triton-repo", str(tiny_export[2]), str(tmp_path / "repo"), "--name", "tiny"]) == 0
    assert (tmp_path / "repo" / "tiny" / "config.pbtxt").is_file()
    assert (tmp_path / "repo" / "tiny" / "1" / "model.onnx").is_file()


def test_infer_writes_segmentation_maps_as_png(tiny_export, tmp_path, monkeypatch, capsys):
    from test_runtime_maps import segmentation_prediction

    from d2export.runtime.maps import read_png_map
    from d2export.runtime.processing import Processing

    # the tiny spotter's runs, answered as a segmentation model would (maps in the original picture's size)
    monkeypatch.setattr(Processing, "prediction", lambda self, outputs, index, input_hw, original_hw, *a, **k:
                        segmentation_prediction(*map(int, original_hw)))
    folder = tmp_path / "pictures"
    (folder / "more").mkdir(parents=True)
    sizes = {"a.png": (90, 130), "more/a.png": (70, 50)}  # one stem twice: a and a_1, as --vis names them
    for name, (h, w) in sizes.items():
        Image.fromarray(synthetic_image(h, w, seed=1).transpose(1, 2, 0)).save(folder / name)
    args = [str(tiny_export[2]), str(folder), "--threads", "1", "--no-progress"]

    def check(lines, maps_dir):
        assert len(lines) == 2
        for line, stem, (h, w) in zip(lines, ["a", "a_1"], sizes.values()):
            want = segmentation_prediction(h, w)
            for key in ("semantic", "panoptic"):
                entry = line[key]
                assert entry == {"shape": [h, w], "png": str(maps_dir / f"{stem}.{key}.png")}
                np.testing.assert_array_equal(read_png_map(Path(entry["png"]).read_bytes()), getattr(want, key))
            assert [s["id"] for s in line["segments"]] == [1, 2, 3, 700]
            assert [i["class_name"] for i in line["instances"]] == ["person", "car"]  # RLE masks stay in the JSON
            assert set(line["instances"][0]["mask"]) == {"size", "counts"}

    out = tmp_path / "results" / "out.jsonl"  # -o FILE: the maps beside it
    out.parent.mkdir()
    assert main(["infer", *args, "-o", str(out)]) == 0
    check([json.loads(line) for line in out.read_text().splitlines()], out.parent)
    # stdout and --vis: the maps beside the pictures of the results
    vis = tmp_path / "vis"
    assert main(["infer", *args, "--vis", str(vis)]) == 0
    check([json.loads(line) for line in capsys.readouterr().out.splitlines()], vis)
    assert sorted(p.name for p in vis.iterdir()) == ["a.panoptic.png", "a.png", "a.semantic.png", "a_1.panoptic.png",
                                                     "a_1.png", "a_1.semantic.png"]
    # stdout alone: ./maps; --maps: there
    monkeypatch.chdir(tmp_path)
    assert main(["infer", *args]) == 0
    check([json.loads(line) for line in capsys.readouterr().out.splitlines()], Path("maps"))
    assert main(["infer", *args, "-o", str(out), "--maps", str(tmp_path / "elsewhere")]) == 0
    check([json.loads(line) for line in out.read_text().splitlines()], tmp_path / "elsewhere")


def test_infer_writes_no_maps_for_other_models(tiny_export, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    picture = tmp_path / "one.png"
    Image.fromarray(synthetic_image(60, 80, seed=2).transpose(1, 2, 0)).save(picture)
    assert main(["infer", str(tiny_export[2]), str(picture), "--threads", "1", "--vis", "vis"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(record) == {"file", "height", "width", "instances"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.png", "vis"]
    assert [p.name for p in (tmp_path / "vis").iterdir()] == ["one.png"]
