"""The support table (docs/support.md) cannot claim more than the suite and the recorded runs show: it is written by
scripts/support_table.py from one list of rows, each with its evidence, and checked here: the file is what the
script writes, every cited test function exists (and asks for the row's route, sampler and config), every cited
row of docs/exporting.md is there (and names the row's route and sampler), and a row without evidence is refused."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("support_table", ROOT / "scripts" / "support_table.py")
support = sys.modules["support_table"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(support)

EVIDENCE = [(row, ev) for row in support.ROWS + support.REFUSED for ev in row.evidence]


def test_support_md_is_what_the_script_writes():
    written = (ROOT / support.OUTPUT).read_text()
    assert written == support.render(), "docs/support.md is stale: run .venv/bin/python scripts/support_table.py"


def test_every_row_has_evidence_and_nothing_is_wrong_with_it():
    assert support.problems() == []
    assert all(row.evidence for row in support.ROWS + support.REFUSED)


@pytest.mark.parametrize("test", sorted({ev for _, ev in EVIDENCE if isinstance(ev, support.Test)},
                                        key=lambda t: (t.path, t.function)), ids=lambda t: t.function)
def test_every_cited_test_function_exists(test):
    tree = ast.parse((ROOT / test.path).read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert test.function in names and test.function.startswith("test_")


@pytest.mark.parametrize("run", sorted({ev for _, ev in EVIDENCE if isinstance(ev, support.Run)},
                                       key=lambda r: (r.section, r.row)), ids=lambda r: r.row.strip("| ")[:40])
def test_every_cited_doc_row_exists(run):
    found = support.sections((ROOT / run.doc).read_text())
    assert run.section in found, f"no heading {run.section!r} in {run.doc}"
    assert sum(run.row in line for line in found[run.section]) == 1, run.row


def test_the_anchor_is_githubs():
    assert support.anchor(support.TORCH_EXPORT) == "through-torchexport-exportexporterdynamo-auto"
    # the anchor exporting.md itself uses for a heading of patches.md
    heading = "Backbones (`d2export/patching/backbones.py`, arithmetic in `d2export/ops/windows.py`)"
    assert support.anchor(heading) == "backbones-d2exportpatchingbackbonespy-arithmetic-in-d2exportopswindowspy"


# --- the checks refuse what they should ------------------------------------------------------------------------------
ROW = support.ROWS[0]  # TESTR, TorchScript, gather, two tests


def _problems(**changes):
    return support.problems([dataclasses.replace(ROW, **changes)])


def test_a_row_without_evidence_is_refused():
    assert any("no evidence" in p for p in _problems(evidence=()))


def test_a_test_that_is_not_there_is_refused():
    found = _problems(evidence=(support.Test("tests/test_export_pipeline.py", "test_no_such_thing"),))
    assert any("no such test function" in p for p in found)
    found = _problems(evidence=(support.Test("tests/test_no_such_file.py", "test_x"),))
    assert any("no such test function" in p for p in found)


def test_a_test_of_another_route_sampler_or_config_is_refused():
    assert any("torch.export" in p for p in _problems(route="torch.export"))  # the tests export through TorchScript
    assert any("sampler=fused" in p for p in _problems(sampler="fused"))
    assert any("names none of the configs" in p for p in _problems(configs=("mask2former_tiny",)))
    dynamo = support.Test("tests/test_dynamo_mask2former.py",
                          "test_the_tiny_mask2former_exports_through_torch_export_verified")
    assert any("row says TorchScript" in p for p in _problems(evidence=(dynamo,), configs=("mask2former_tiny",)))


def test_a_recorded_run_that_is_gone_or_says_otherwise_is_refused():
    gone = support.Run(support.TORCH_EXPORT, "InternImage (`dino_internimage_tiny`)")
    assert any("0 table rows" in p for p in _problems(evidence=(gone,), configs=()))
    heading = support.Run("No such heading", "TESTR")
    assert any("no such heading" in p for p in _problems(evidence=(heading,), configs=()))
    # detrex's InternImage clone was run through TorchScript only: its row cannot show torch.export
    internimage = support.Run(support.BACKBONES, "`dino-internimage/dino_internimage_tiny_4scale_12ep.py`")
    assert _problems(evidence=(internimage,), configs=()) == []
    assert any("not a torch.export run" in p for p in _problems(evidence=(internimage,), configs=(),
                                                                route="torch.export"))
    # a torch.export row cannot show TorchScript unless it records a TorchScript run too
    tiny = support.Run(support.TORCH_EXPORT, "DPText-DETR (`dptext_tiny`)")
    assert any("no TorchScript run" in p for p in _problems(evidence=(tiny,), configs=()))


def test_readme_and_exporting_link_the_table():
    readme = (ROOT / "README.md").read_text()
    where_next = readme[readme.index("## Where next"):]
    assert "(docs/support.md)" in where_next
    assert "(support.md)" in (ROOT / "docs" / "exporting.md").read_text()
