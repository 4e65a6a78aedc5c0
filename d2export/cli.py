"""The `d2export` command: `d2export COMMAND --help` for each command's options.

`d2export export --config textdet [key=value …]` is `tools/export.py`. Configs are Hydra's: `--config` takes a bare
name (looked up in ./configs, then in the repository's configs/) or a path to a YAML; everything after it is Hydra's
override grammar, and `--multirun` sweeps (ending in one table).
"""
from __future__ import annotations

import difflib
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

# HelpFormatter: d2export.cli's name too
from d2export.argparsing import HelpFormatter, export_side_missing, one_line, parser  # noqa: F401

log = logging.getLogger("d2export")

# name → ("module:function", one line): the functions take argv and return an exit status
COMMANDS = {
    "export": ("d2export.cli:export_main", "export a detectron2 model to ONNX, verified against PyTorch"),
    "infer": ("d2export.runtime:infer_main", "run an exported model over pictures: JSON lines, pictures with --vis"),
    "serve": ("d2export.runtime:serve_main", "serve an exported model over HTTP (POST /predict, /healthz, /metadata)"),
    "triton-repo": ("d2export.runtime:triton_main", "write a Triton Inference Server model repository for a model"),
    "batch": ("d2export.runtime:batch_main", "run an exported model over a picture corpus with Ray Data (resumable)"),
    "diagnose": ("d2export.diagnose:diagnose_main", "name the first module where ONNX and PyTorch part ways"),
    "evaluate": ("d2export.evaluating.evaluate:evaluate_main",
                 "a dataset's metrics under PyTorch and each exported model, side by side"),
    "synth": ("d2export.datasets.synth:synth_main", "make a labelled synthetic set (text or boxes) as COCO JSON"),
}
# the commands that need `pip install 'd2export[export]'` (torch, detectron2, Hydra…); the others serve with the runtime
EXPORT_COMMANDS = ("export", "diagnose", "evaluate", "synth")


def run_export(cfg: Any) -> dict:
    """One Hydra job: returns a summary row for sweeps. The config is checked whole before anything is built."""
    from d2export.config import check_files, resolve

    typed = resolve(cfg)
    check_files(typed, Path.cwd())  # a mistyped path said in a second, before torch and the model code are imported
    from d2export import pipeline

    manifest = pipeline.export(typed)
    v = manifest.verification
    return {"exporter": manifest.exporter, "opset": typed.export.opset, "sampler": typed.export.sampler,
            "seconds": manifest.export_seconds, "verified": v.get("passed"), "max_abs": v.get("max_abs"),
            "model": str(Path(typed.export.output_dir) / manifest.model_file)}


MOST_USED = ("model.weights", "model.d2_config", "export.opset", "export.sampler", "export.exporter",
             "export.target", "export.fp16", "export.dummy_sizes", "verify.sizes", "verify.atol")

EXAMPLES = """examples:
  d2export export --config textdet model.weights=/path/testr_totaltext.pth
  d2export export --config textdet_tiny export.fp16=true export.opset=16 export.sampler=grid_sample
  d2export export --config textdet --multirun export.sampler=gather,grid_sample export.opset=16,17
  d2export export --config textdet --cfg job          # print the composed config and exit (Hydra's --cfg)
"""


def export_epilog() -> str:
    from d2export.config import groups, schema_rows

    rows = {k: (d, m) for k, _, d, m in schema_rows()}
    width = max(map(len, MOST_USED)) + 2
    lines = ["config groups (override any key as group.key=value; every key: docs/config.md):"]
    lines += [f"  {g:<{width}}{m}" for g, m in groups()]
    lines += ["", "most used keys (default → meaning):"]
    lines += [f"  {k:<{width}}{rows[k][0]} → {rows[k][1]}" for k in MOST_USED]
    return "\n".join(lines) + "\n\n" + EXAMPLES


# Hydra's own flags, passed through as Hydra takes them (no `--` needed)
HYDRA_FLAGS = {
    "--cfg": dict(choices=["job", "hydra", "all"], help="Hydra: print the composed config (job, hydra or all) and exit (default: export)"),
    "--resolve": dict(action="store_true", help="Hydra: with --cfg, resolve interpolations first"),
    "--package": dict(metavar="PKG", help="Hydra: with --cfg, print only this package, e.g. export (default: all)"),
    "--info": dict(nargs="?", const="all", metavar="TOPIC",
                   help="Hydra: print information (all, config, defaults, defaults-tree, plugins, searchpath) and exit (default: export)"),
}


def export_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser("d2export export", "Export a detectron2 model to ONNX, verified against eager PyTorch at several sizes. "
                "Nothing is written at the destination unless every step passed.", export_epilog())
    ap.add_argument("--config", default="textdet", help="config name in configs/ or a YAML path")
    ap.add_argument("-m", "--multirun", action="store_true", help="sweep over comma-separated override values")
    ap.add_argument("--traceback", "--verbose", action="store_true", help="show full tracebacks on errors")
    for flag, kwargs in HYDRA_FLAGS.items():
        ap.add_argument(flag, **kwargs)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. export.opset=16 export.sampler=grid_sample")
    args = ap.parse_args(argv)
    from d2export.config import find_config, register_configs

    try:
        path = find_config(args.config)
    except FileNotFoundError as e:
        print(one_line(e), file=sys.stderr)
        return 2

    import hydra
    from omegaconf import DictConfig

    register_configs()
    failures: list[str] = []

    @hydra.main(version_base=None, config_path=str(path.parent), config_name=path.stem)
    def job(cfg: DictConfig) -> dict | None:
        try:
            return run_export(cfg)
        except Exception as e:  # noqa: BLE001 - one line per failure, the traceback on request
            if args.traceback or cfg.get("traceback", False):
                raise
            print(export_side_missing(e, "export") or one_line(e), file=sys.stderr)
            failures.append(str(e))
            return None

    hydra_argv = [sys.argv[0], *args.overrides] + (["--multirun"] if args.multirun else [])
    for flag in HYDRA_FLAGS:
        value = getattr(args, flag[2:])
        if value is True:
            hydra_argv.append(flag)
        elif value not in (None, False):
            hydra_argv += [flag, value]
    saved, sys.argv = sys.argv, hydra_argv
    try:
        job()
    finally:
        sys.argv = saved
    return 1 if failures else 0


def top_help() -> str:
    from d2export import __version__

    width = max(map(len, COMMANDS)) + 2
    lines = [f"usage: d2export [-h] [--version] COMMAND [ARGS …]", "",
             f"d2export {__version__}: detectron2 detectors to verified ONNX, and serving them.", "", "commands:"]
    lines += [f"  {name:<{width}}{what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help   show this help and exit", "  --version    show the version and exit", "",
              "Run `d2export COMMAND --help` for a command's options; docs/config.md lists every export key."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from d2export import __version__

        print(f"d2export {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"d2export: error: unknown command '{argv[0]}'{hint} (commands: {', '.join(COMMANDS)}; "
              "d2export --help)", file=sys.stderr)
        return 2
    module, func = COMMANDS[argv[0]][0].split(":")
    try:
        return getattr(importlib.import_module(module), func)(argv[1:])
    except ModuleNotFoundError as e:  # the export side asked of the serving runtime alone: the line that installs it
        line = export_side_missing(e, argv[0]) if argv[0] in EXPORT_COMMANDS else None
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
