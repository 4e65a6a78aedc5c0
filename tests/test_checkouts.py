"""Upstream checkouts exactly as their users have them: a detrex clone never installed, configs that moved between
releases, the family that fits a model built under the wrong one, and errors from other people's code in one line."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from d2export import building, pipeline
from d2export.config import ConfigError, check_files, lazy_config_path, load
from d2export.stage_errors import StageError, stage

REPO = Path(__file__).resolve().parents[1]
DINO = "third_party/detrex_standin/projects/dino/configs/dino-resnet/dino_r50_4scale_12ep.py"


def test_a_detrex_clone_loads_its_configs_without_the_install_link(tmp_path):
    from d2export import lazyconfig

    cfg = load("dino_tiny", [f"export.output_dir={tmp_path}"])
    building.import_user_code(cfg.model, cfg.plugin, REPO)  # as export does: detrex imported with _C stood in for
    import detrex.config

    assert not (Path(detrex.config.__file__).parent / "configs").exists()  # laid out like a fresh clone
    cfg = lazyconfig.load(REPO / DINO)
    assert cfg.dataloader.test.dataset.names == "coco_2017_val"  # from the checkout's configs/common/data
    with pytest.raises(RuntimeError, match="not available in detrex configs"):
        detrex.config.get_config("common/data/coco_detr.py")  # outside the load: detrex as it is


def test_a_config_path_of_another_release_finds_the_file(tmp_path):
    old = "third_party/detrex_standin/projects/dino/configs/dino_r50_4scale_12ep.py"  # where older detrex kept it
    assert lazy_config_path(REPO, old) == REPO / DINO
    cfg = load("dino_tiny", [f"model.lazy_config={old}", f"export.output_dir={tmp_path}"])
    check_files(cfg, REPO)  # accepted
    missing = load("dino_tiny", ["model.lazy_config=third_party/detrex_standin/projects/dino/configs/nothing.py",
                                 f"export.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="nothing.py: no such file"):
        check_files(missing, REPO)


def test_a_refused_family_names_the_family_that_fits(tmp_path):
    cfg = load("dptext_tiny", ["model.family=testr", f"export.output_dir={tmp_path}"])
    with pytest.raises(building.UserError, match=r"family 'dptext' fits it: model.family=dptext"):
        pipeline.prepare(cfg)


def _fails_in_user_code():
    value = 2
    assert value == 1


def test_an_error_inside_other_code_is_one_line_with_stage_and_place():
    with pytest.raises(StageError) as error:
        with stage("verify"):
            _fails_in_user_code()
    message = str(error.value)
    assert "\n" not in message
    line = _fails_in_user_code.__code__.co_firstlineno + 2
    # pytest rewrites the assert's message; plain Python leaves it empty and the source line is shown
    assert re.match(rf"verify: AssertionError: assert (value|2) == 1 \(tests/test_checkouts.py:{line}\)", message), message
    assert isinstance(error.value.__cause__, AssertionError)  # --traceback still shows where it came from


def test_d2export_s_own_errors_pass_through_unchanged():
    with pytest.raises(building.UserError, match="^our own words$"):
        with stage("build"):
            raise building.UserError("our own words")


def test_a_missing_upstream_import_says_which_line_to_run():
    with pytest.raises(StageError, match=r"run `pip install wandb`"):
        with stage("import"):
            raise ModuleNotFoundError("No module named 'wandb'", name="wandb")


def test_an_assert_in_the_model_during_export_is_one_line(tmp_path):
    built = pipeline.prepare(load("textdet_tiny", [f"export.output_dir={tmp_path}"]))

    def broken(*args, **kwargs):
        raise AssertionError("roi_map_scores differ")  # as detectron2's heatmaps_to_keypoints does

    built.model.testr.transformer.bbox_class_embed.forward = broken
    with pytest.raises(StageError, match=r"^verify: AssertionError: roi_map_scores differ \(tests/test_checkouts.py"):
        pipeline.export(built.cfg, built=built)
    assert not list(tmp_path.glob("*.onnx"))
    assert torch.is_tensor(torch.zeros(1))


def test_a_bare_assert_in_user_code_shows_its_source_line(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "user_head.py").write_text("def decode():\n    ready = False\n    assert ready\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user_head = importlib.import_module("user_head")
    with pytest.raises(StageError) as error:
        with stage("export"):
            user_head.decode()
    assert str(error.value).startswith("export: AssertionError: assert ready (")
    assert "user_head.py:3)" in str(error.value)
