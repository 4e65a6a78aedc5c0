"""Argparse helpers every `d2export` command shares: the parser style and the one-line error.

Low in the house on purpose: commands (export, the runtime's, diagnose, evaluate, synth) and the benchmark scripts
import these, and none of them imports the dispatcher (`d2export/cli.py`), which only names the commands. Imports
neither torch nor detectron2 (the runtime must stay importable without them).
"""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option that takes a value shows its default (unless its help
    already says what the default is)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def parser(prog: str, description: str, epilog: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """An argparse parser in d2export's style (defaults shown, text kept as written)."""
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter,
                                   **kwargs)


def one_line(e: BaseException) -> str:
    return f"d2export: error: {e}".replace("\n", "\n  ") if str(e) else f"d2export: error: {type(e).__name__}"


# What `pip install 'd2export[export]'` adds to the serving runtime (`pip install d2export`), by top-level module, and
# detectron2, which scripts/install_detectron2.py installs (it is not on the registry for every Python)
EXPORT_SIDE = ("torch", "torchvision", "onnxscript", "hydra", "omegaconf", "detectron2")
EXPORT_INSTALL = "pip install 'd2export[export]'"


def export_side_missing(e: BaseException | None, command: str) -> str | None:
    """The one line for a command run where only the serving runtime is installed: a top-level package of the export
    side missing anywhere in the exception's chain (not a submodule of one that is installed, say detectron2._C).
    None for any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        top = (e.name or "") if isinstance(e, ModuleNotFoundError) else ""
        if top in EXPORT_SIDE:
            then = (", then detectron2 (`python scripts/install_detectron2.py` in a clone, or your own build: "
                    "docs/setup.md)" if top == "detectron2" else "")
            return (f"d2export: error: `d2export {command}` needs the export side, which this install lacks (no module "
                    f"named {top!r}): {EXPORT_INSTALL}{then}")
        e = e.__cause__ or e.__context__
    return None
