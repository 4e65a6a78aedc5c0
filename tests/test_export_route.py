"""The route `export.exporter=auto` chooses is a result, not a mutation of the config: the lint's second trace, the
ladder on failure, the manifest and the CLI's summary row read it from the export's result, and the config the user
passed still says `auto` afterwards. (The real torch.export fallback: tests/test_dynamo_exporter.py, in the matrix.)"""
import dataclasses
from types import SimpleNamespace

import pytest

from d2export import pipeline
from d2export.config import load


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return pipeline.prepare(load("textdet_tiny", [f"export.output_dir={tmp_path_factory.mktemp('route')}",
                                                  "export.exporter=auto", "verify.sizes=[[160,224]]",
                                                  "verify.batch=false"]))


def test_the_route_auto_chose_is_recorded_and_the_config_still_says_auto(built, tmp_path, monkeypatch):
    from d2export.exporting import onnx_export

    real, asked = onnx_export._run_exporter, []

    def torchscript_fails_first(*args):  # a torch whose TorchScript exporter fails, once
        asked.append(args[-1])
        if len(asked) == 1:
            raise RuntimeError("this torch's TorchScript-based exporter failed")
        return real(*args[:-1], "torchscript")  # the graph itself, quickly: the route is what is under test

    monkeypatch.setattr(onnx_export, "_run_exporter", torchscript_fails_first)
    cfg = dataclasses.replace(built.cfg, export=dataclasses.replace(built.cfg.export, output_dir=str(tmp_path)))
    manifest = pipeline.export(cfg, built=dataclasses.replace(built, cfg=cfg))
    assert manifest.exporter == "dynamo"
    assert cfg.export.exporter == "auto" and built.cfg.export.exporter == "auto"  # never written back
    assert asked == ["torchscript", "dynamo", "dynamo"]  # the lint's second trace through the route that wrote it
    assert manifest.verification["passed"] is True


def test_the_ladder_on_failure_retraces_through_the_route_that_wrote_the_graph(built, monkeypatch):
    from d2export.verification import ladder
    from d2export.verification.subject import Subject

    seen, report = [], SimpleNamespace(culprit=lambda: None, format=str, to_dict=dict)
    monkeypatch.setattr(ladder, "run_ladder", lambda adapter, settings, *a, **k: seen.append(settings.exporter)
                        or report)
    ladder._ladder_summary(Subject(built, None, [], "dynamo"))
    ladder._ladder_summary(Subject(built, None, []))  # no route recorded: auto's first
    pipeline.ladder(built)
    assert seen == ["dynamo", "torchscript", "torchscript"]
    assert built.cfg.export.exporter == "auto"


def test_a_built_model_prepared_from_another_config_is_refused(built, tmp_path):
    other = load("textdet_tiny", [f"export.output_dir={tmp_path}", "export.opset=16"])
    with pytest.raises(ValueError, match="prepared from another config"):
        pipeline.export(other, built=built)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_the_sweep_summary_row_names_the_route_from_the_manifest(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from d2export import cli
    from d2export.manifest import Manifest

    def export(typed):
        assert typed.export.exporter == "auto"
        return Manifest(model_file="model.onnx", family="testr", inputs=[], outputs=[], opset=17, exporter="dynamo",
                        verification={"passed": True})

    monkeypatch.setattr(pipeline, "export", export)
    cfg = OmegaConf.structured(load("textdet_tiny", [f"export.output_dir={tmp_path}", "export.exporter=auto"]))
    assert cli.run_export(cfg)["exporter"] == "dynamo"
