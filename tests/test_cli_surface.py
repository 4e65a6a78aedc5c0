"""The command line explains itself, and the config is checked whole before anything is built."""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from d2export import __version__
from d2export.cli import COMMANDS, MOST_USED, HelpFormatter, main
from d2export.config import ConfigError, load, schema_rows

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def test_top_level_help_lists_every_command_with_a_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20  # a description, not just the name
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"d2export {__version__}"


@pytest.mark.parametrize("typed, meant", [("exprot", "export"), ("serv", "serve"), ("triton", "triton-repo")])
def test_unknown_command_is_named_with_the_closest(capsys, typed, meant):
    assert main([typed]) == 2
    err = capsys.readouterr().err
    assert f"unknown command '{typed}'" in err and f"did you mean '{meant}'" in err


class _Parsed(Exception):
    pass


def _parser_of(monkeypatch, entry, argv: list[str]) -> argparse.ArgumentParser:
    """The parser a command builds, caught as it parses."""
    seen = {}

    def catch(self, args=None, namespace=None):
        seen["parser"] = self
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed):
        entry(argv)
    return seen["parser"]


def _check_help(ap: argparse.ArgumentParser) -> None:
    formatter = HelpFormatter(ap.prog)
    for action in ap._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{ap.prog} {action.option_strings or action.dest} has no help text"
        if action.option_strings and action.nargs != 0:
            assert "default" in formatter._get_help_string(action), f"{ap.prog} {action.option_strings}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_help_and_shows_its_default(monkeypatch, command):
    ap = _parser_of(monkeypatch, main, [command, "--help"])
    assert ap.description and not ap.description.rstrip().endswith((",", "(", "and", "the"))
    _check_help(ap)


@pytest.mark.parametrize("sub", ["msda", "e2e", "serve", "batch", "precision"])
def test_benchmark_options_have_help_and_defaults(monkeypatch, sub):
    sys.path.insert(0, str(REPO))
    _check_help(_parser_of(monkeypatch, importlib.import_module(f"benchmarks.{sub}").main, ["--help"]))


def test_benchmark_tool_help_exits_zero():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmark.py"), "--help"], capture_output=True,
                       text=True, env=ENV)
    assert r.returncode == 0 and all(s in r.stdout for s in ("msda", "e2e", "serve", "batch"))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "benchmark.py"), "bogus"], capture_output=True,
                       text=True, env=ENV)
    assert r.returncode == 2 and "bogus" in r.stderr


def test_export_help_shows_groups_keys_and_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    defaults = {k: d for k, _, d, _ in schema_rows()}
    for group in ("model", "plugin", "export", "verify"):
        assert f"\n  {group} " in out
    for key in MOST_USED:
        line = next(line for line in out.splitlines() if line.strip().startswith(key + " "))
        assert defaults[key] in line
    assert sum(line.strip().startswith("d2export export --config") for line in out.splitlines()) >= 3
    assert "--cfg" in out and "--info" in out


def test_hydra_cfg_job_prints_the_composed_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "d2export.cli", "export", "--config", "textdet_tiny", "--cfg", "job",
                        "export.opset=16"], capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "opset: 16" in r.stdout and "d2_config: third_party/testr/configs/tiny.yaml" in r.stdout
    assert not (tmp_path / "outputs").exists()  # printed, nothing run


def test_bad_sampler_is_refused_before_anything_is_built(tmp_path):
    """No model is built: the refusal comes before torch is even imported."""
    code = ("import sys; from d2export.cli import main; "
            f"rc = main(['export', '--config', 'textdet_tiny', 'export.sampler=bogus', 'hydra.run.dir={tmp_path}']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO)
    assert r.returncode == 1, r.stderr
    assert "export.sampler='bogus'" in r.stderr and "gather" in r.stderr
    assert not list(tmp_path.glob("*.onnx"))


@pytest.mark.parametrize("override, says", [
    ("export.sampler=gathr", "did you mean gather"),
    ("export.exporter=onnx", "export.exporter"),
    ("export.target=trt", "export.target"),
    ("export.opset=9", "export.opset=9"),
    ("export.opset=21 export.target=tensorrt", "tensorrt takes 16–19"),
    ("verify.sizes=[[0,0]]", "positive"),
    ("verify.sizes=[[20000,20000]]", "export.max_pixels"),
    ("export.dummy_sizes=[[320,-1]]", "positive"),
    ("export.dummy_sizes=[[4096,4096]] export.max_pixels=1000000", "export.max_pixels"),
    ("model.family=tesr", "did you mean testr"),
    ("verify.atol=-1", "verify.atol"),
])
def test_config_values_are_checked_up_front(override, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
        load("textdet_tiny", override.split() + ["export.output_dir=/nonexistent"])


def test_named_files_are_checked_before_importing(tmp_path):
    from d2export import pipeline

    cfg = load("textdet_tiny", ["export.output_dir=/nonexistent", "model.weights=missing.pth"])
    with pytest.raises(ConfigError, match="model.weights=missing.pth: no such file"):
        pipeline.prepare(cfg, REPO)
    cfg = load("textdet_tiny", ["export.output_dir=/nonexistent", "model.d2_config=nowhere.yaml"])
    with pytest.raises(ConfigError, match="model.d2_config"):
        pipeline.prepare(cfg, REPO)


def test_config_reference_is_current():
    sys.path.insert(0, str(REPO / "scripts"))
    config_doc = importlib.import_module("config_doc")
    assert config_doc.main(["--check"]) == 0, "docs/config.md is stale: run python scripts/config_doc.py"
    text = (REPO / "docs" / "config.md").read_text()
    for key, _, default, meaning in schema_rows():
        assert meaning.strip(), f"{key} has no meaning in the schema"
        assert f"| `{key}` |" in text


def test_every_choice_is_documented():
    from d2export.config import EXPORTERS, SAMPLERS, TARGETS

    meaning = {k: m for k, _, _, m in schema_rows()}
    for key, choices in [("export.sampler", SAMPLERS), ("export.exporter", EXPORTERS), ("export.target", TARGETS)]:
        assert all(c in meaning[key] for c in choices), key
