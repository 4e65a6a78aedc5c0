"""The 0.2 layout moved modules; their old names still import, warn, and answer with the new module itself."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from d2export.moved import MOVED

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_warns_and_is_the_new_module(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_names_are_no_files_and_new_names_are():
    for old, new in MOVED.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old  # else the alias would never be reached
        assert (ROOT / (new.replace(".", "/") + ".py")).exists(), new


def test_names_never_defined_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("d2export.runtime.no_such_module")


def test_an_old_serving_import_stays_torch_free():
    # what a script written for the old layout does on a serving image: the alias loads no export side
    code = ("import warnings, sys; warnings.simplefilter('ignore')\n"
            "from d2export.runtime import custom_ops, session_cache\n"
            "assert custom_ops.__name__ == 'd2export.kernels.custom_ops'\n"
            "print(sorted({'torch', 'detectron2'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
