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
