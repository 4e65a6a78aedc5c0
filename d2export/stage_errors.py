"""The export's stages, and errors from other people's code said in one line.

An exception raised inside the user's model code or a library (detectron2, torch, onnxruntime) while a stage runs
becomes a `StageError`: the stage, the exception and its message (or, for a bare assert, its source line), and the
innermost frame outside d2export. d2export's own errors already say what to do and pass through unchanged. The
original exception stays chained (`--traceback` prints it whole).
"""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from typing import Iterator

_PACKAGE = Path(__file__).resolve().parent

# what upstream checkouts import at module level beside d2export's own requirements (docs/exporting.md: "Upstream
# checkouts"), by the name Python reports missing → the line that installs it
INSTALL_LINES = {
    "timm": "pip install timm", "scipy": "pip install scipy", "einops": "pip install einops",
    "fairscale": "pip install fairscale", "cv2": "pip install opencv-python-headless", "wandb": "pip install wandb",
}


class StageError(RuntimeError):
    """An exception from the user's or a library's code, at one stage of the export."""


def _outside(filename: str) -> bool:
    return not Path(filename).resolve().is_relative_to(_PACKAGE)


def _short(filename: str) -> str:
    """A library's file from its package down (…/site-packages/detectron2/x.py → detectron2/x.py)."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return str(Path(*parts[parts.index(marker) + 1:]))
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def describe(e: BaseException) -> str | None:
    """One line for an exception raised outside d2export; None for d2export's own (its classes, its frames)."""
    frames = traceback.extract_tb(e.__traceback__)
    if type(e).__module__.split(".")[0] == __name__.split(".")[0] or not frames or not _outside(frames[-1].filename):
        return None
    where = frames[-1]
    message = str(e).strip().splitlines()[0] if str(e).strip() else (where.line or "").strip()
    return f"{type(e).__name__}: {message} ({_short(where.filename)}:{where.lineno})"


def install_line(e: BaseException) -> str | None:
    """For a missing module that upstream code imports (anywhere in the exception's chain): the line to run."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in INSTALL_LINES:
            return INSTALL_LINES[e.name.split(".")[0]]
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Runs a stage ('import', 'build', 'export', 'verify'): an exception from outside d2export leaves it as a
    one-line StageError naming the stage; a module that upstream code imports and the venv lacks is named with the
    line that installs it."""
    try:
        yield
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised, said in one line
        line, install = describe(e), install_line(e)
        hint = (f"; the checkout imports it at module level: run `{install}` (docs/exporting.md: upstream checkouts)"
                if install else "")
        if line is None and not hint:
            raise
        raise StageError(f"{name}: {line or e}{hint}" + ("" if hint else "; --traceback shows the whole trace")) \
            from e
