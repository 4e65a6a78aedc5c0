"""The `d2export` command. `d2export export --config textdet [key=value …]` is `tools/export.py`.

Configs are Hydra's: `--config` takes a bare name (looked up in ./configs, then in the repository's configs/) or a
path to a YAML; everything after it is Hydra's override grammar, and `--multirun` sweeps (ending in one table).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("d2export")


def one_line(e: BaseException) -> str:
    return f"d2export: error: {e}".replace("\n", "\n  ") if str(e) else f"d2export: error: {type(e).__name__}"


def run_export(cfg: Any) -> dict:
    """One Hydra job: returns a summary row for sweeps."""
    from d2export import pipeline
    from d2export.config import resolve

    typed = resolve(cfg)
    manifest = pipeline.export(typed)
    v = manifest.verification
    return {"exporter": typed.export.exporter, "opset": typed.export.opset, "sampler": typed.export.sampler,
            "seconds": manifest.export_seconds, "verified": v.get("passed"), "max_abs": v.get("max_abs"),
            "model": str(Path(typed.export.output_dir) / manifest.model_file)}


def export_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="d2export export", description="Export a detectron2 model to verified ONNX.")
    ap.add_argument("--config", default="textdet", help="config name in configs/ or a YAML path (default textdet)")
    ap.add_argument("-m", "--multirun", action="store_true", help="sweep over comma-separated override values")
    ap.add_argument("--traceback", action="store_true", help="show full tracebacks on errors")
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
            print(one_line(e), file=sys.stderr)
            failures.append(str(e))
            return None

    hydra_argv = [sys.argv[0], *args.overrides] + (["--multirun"] if args.multirun else [])
    saved, sys.argv = sys.argv, hydra_argv
    try:
        job()
    finally:
        sys.argv = saved
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from d2export import runtime
    from d2export.diagnose import diagnose_main

    commands = {"export": export_main, "infer": runtime.infer_main, "serve": runtime.serve_main,
                "triton-repo": runtime.triton_main, "batch": runtime.batch_main, "diagnose": diagnose_main}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: d2export {" + ",".join(commands) + "} …", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
