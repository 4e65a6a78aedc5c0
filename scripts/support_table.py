"""What d2export has been shown to export, and what shows it: the one list the support table in docs/support.md is
written from.

Each row is a combination (family, backbone, whose code, route, sampler) with its evidence: a test function of the
suite (`Test`), or a run recorded in a table row of docs/exporting.md (`Run`: an unedited clone or a tiny config
exported by hand, with the figures it gave). A row without evidence, a test that does not exist or does not use the
row's route, sampler or config, or a recorded row that is gone is a problem (`problems()`), and
tests/test_support_table.py fails on any, and on a docs/support.md that differs from what this script writes.

    .venv/bin/python scripts/support_table.py            # write docs/support.md
    .venv/bin/python scripts/support_table.py --check    # exit 1 if it is stale or a row lacks evidence
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = "docs/support.md"
EXPORTING = "docs/exporting.md"
TORCH_EXPORT = "Through torch.export (`export.exporter=dynamo`, `auto`)"
BACKBONES = "Backbones: Swin, ViTDet and the rest"
SPOTTER_RUNS = "Text spotters: what was run and what is served"

ROUTES = ("TorchScript", "torch.export", "any")  # any: refused whatever the route
SAMPLERS = ("gather", "grid_sample", "fused", "—")  # "—": no deformable attention in the model
CODES = ("stand-in", "unedited clone", "detectron2")


@dataclass(frozen=True)
class Test:
    """A test function of the suite: `path` (from the repository root) and the function's name."""
    path: str
    function: str

    def cite(self) -> str:
        return f"[`{Path(self.path).name}::{self.function}`](../{self.path})"


@dataclass(frozen=True)
class Run:
    """A run recorded in a table of `doc`: the one table row under the heading `section` that contains `row`."""
    section: str
    row: str
    doc: str = EXPORTING

    def cite(self) -> str:
        label = self.row.strip("| ").replace("|", "/")  # a table cell cannot hold a bare "|"
        if label.count("(") > label.count(")"):  # a key cut inside a parenthesis: up to it
            label = label[:label.rindex("(")].strip()
        return f"[{Path(self.doc).name}: {label}]({Path(self.doc).name}#{anchor(self.section)})"


@dataclass(frozen=True)
class Row:
    family: str
    backbone: str
    code: str       # stand-in (third_party/), unedited clone (upstream's repository as cloned), detectron2 (installed)
    route: str
    sampler: str
    shown: str      # what was verified, briefly
    evidence: tuple = ()
    configs: tuple = ()  # config names a cited test must mention (its file, fixtures or helpers)


def clone(*rows: str) -> tuple:
    """Rows of docs/exporting.md's table of unedited-clone runs (in the backbones section)."""
    return tuple(Run(BACKBONES, r) for r in rows)


def dynamo(*rows: str) -> tuple:
    """Rows of docs/exporting.md's torch.export tables."""
    return tuple(Run(TORCH_EXPORT, r) for r in rows)


SPOTTERS = "tests/test_spotters.py::test_tiny_export_verifies_at_five_sizes_and_a_mixed_batch"
DETR = "tests/test_detr_boxes.py::test_export_verifies_at_five_sizes_and_a_mixed_batch_with_a_clean_lint"
DINO_BACKBONES = "tests/test_dino_backbones.py::test_dino_exports_verified_at_sizes_and_a_mixed_batch"
ZOO = "tests/test_zoo_families.py::test_zoo_model_exports_and_verifies_at_a_size_and_its_transpose"
DYNAMO_D2 = "tests/test_dynamo_detectron2.py"
ONEFORMER_MASKDINO_R50 = "OneFormer, MaskDINO (unedited clones, full R-50"
DINO_TINY_BACKBONES = "`dino_vitdet_tiny`, `dino_convnext_tiny`, `dino_focalnet_tiny`"


def t(spec: str) -> Test:
    path, function = spec.split("::")
    return Test(path, function)


ROWS: tuple[Row, ...] = (
    # --- text spotters (AdelaiDet lineage) ---------------------------------------------------------------------------
    Row("TESTR", "ResNet-50", "stand-in", "TorchScript", "gather",
        "tiny: default sizes, a mixed batch, lint; full size: one size (256x400)",
        (t("tests/test_export_pipeline.py::test_tiny_export_is_verified_and_described"),
         t("tests/test_export_pipeline.py::test_full_size_default_config_exports_and_verifies")),
        ("textdet_tiny", "textdet")),
    Row("TESTR", "ResNet-50", "stand-in", "TorchScript", "grid_sample", "tiny: one size, no batch",
        (t("tests/test_export_pipeline.py::test_cli_multirun_ends_with_one_summary_table"),), ("textdet_tiny",)),
    Row("TESTR", "ResNet-50", "stand-in", "TorchScript", "fused",
        "tiny: default sizes and a mixed batch; full size: recorded parity at 640²",
        (t("tests/test_fused_msda.py::test_fused_export_is_verified_and_named_in_the_manifest"),
         Run(TORCH_EXPORT, "| fused, TorchScript |")), ("textdet_tiny",)),
    Row("TESTR", "ResNet-50", "stand-in", "torch.export", "gather", "tiny and full size, by hand",
        dynamo("TESTR (`textdet_tiny`)", "| gather, torch.export |")),
    Row("TESTR", "ResNet-50", "stand-in", "torch.export", "fused",
        "tiny: two sizes and a batch (through `auto`); full size by hand",
        (t("tests/test_dynamo_exporter.py::test_auto_falls_back_to_torch_export_and_fused_is_one_node_per_attention"),
         Run(TORCH_EXPORT, "| fused, torch.export |")), ("textdet_tiny",)),
    Row("DPText-DETR", "ResNet-50", "stand-in", "TorchScript", "gather", "tiny: five sizes, a mixed batch, lint",
        (t(SPOTTERS),), ("dptext_tiny",)),
    Row("DPText-DETR", "ResNet-50", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo("DPText-DETR (`dptext_tiny`)")),
    Row("DeepSolo", "ResNet-50", "stand-in", "TorchScript", "gather", "tiny: five sizes, a mixed batch, lint",
        (t(SPOTTERS),), ("deepsolo_tiny",)),
    Row("DeepSolo", "ResNet-50", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo("DeepSolo (`deepsolo_tiny`)")),
    Row("DeepSolo", "Swin-T (detectron2's copy)", "stand-in", "TorchScript", "gather",
        "four sizes and a mixed batch",
        (t("tests/test_swin_backbone.py::test_deepsolo_on_swin_exports_verified_at_sizes_and_a_mixed_batch"),),
        ("deepsolo_swin_tiny",)),
    Row("DeepSolo", "Swin-T (detectron2's copy)", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo("DeepSolo Swin-T (`deepsolo_swin_tiny`)")),
    Row("DeepSolo", "Swin-T (`adet/modeling/swin`)", "unedited clone", "TorchScript", "gather",
        "full Swin-T: five sizes and a mixed batch, by hand",
        clone("DeepSolo `configs/Swin_T/TotalText/finetune_150k_tt_mlt_13_15.yaml`")),
    Row("DeepSolo", "ViTAEv2-S", "unedited clone", "TorchScript", "gather",
        "224², 320², 256x192, 192x256 (multiples of 32: its own code's) and a mixed batch, by hand",
        clone("| ViTAEv2 (DeepSolo ViTAEv2-S) |")),
    Row("DeepSolo", "ViTAEv2-S", "unedited clone", "torch.export", "gather",
        "five sizes (multiples of 32, given as `verify.sizes`) and a mixed batch, by hand",
        dynamo("DeepSolo ViTAEv2-S (unedited clone")),
    # --- spotters built on them (issue 93) ---------------------------------------------------------------------------
    Row("DNTextSpotter (deepsolo)", "ResNet-50", "stand-in", "TorchScript", "gather",
        "tiny: five sizes, a mixed batch, served words against its own reading",
        (t("tests/test_spotter_variants.py::test_dntextspotter_head_returning_a_pair_exports_and_serves_its_own_words"),),
        ("dntextspotter_tiny",)),
    Row("DNTextSpotter (deepsolo)", "ResNet-50", "unedited clone", "TorchScript", "gather",
        "TotalText: four sizes and a mixed batch, 200 of 200 words its own, by hand",
        (Run(SPOTTER_RUNS, "| DNTextSpotter R-50 TotalText |"),)),
    Row("DNTextSpotter (deepsolo)", "ResNet-50, Swin-T, ViTAEv2-S", "unedited clone", "TorchScript", "gather",
        "CTW1500 (96 classes, 50 points), IC15; Swin-T and ViTAEv2-S TotalText (multiples of 32 found): four sizes "
        "and a mixed batch each, 200 of 200 words its own, by hand",
        (Run(SPOTTER_RUNS, "| DNTextSpotter R-50 CTW1500, IC15; Swin-T and ViTAEv2-S TotalText |"),)),
    Row("SRFormer", "ResNet-50", "stand-in", "TorchScript", "gather",
        "tiny: five sizes, a mixed batch, scores against its own inference",
        (t("tests/test_spotter_variants.py::test_srformer_is_its_own_variant_scored_per_query"),), ("srformer_tiny",)),
    Row("SRFormer", "ResNet-50", "unedited clone", "TorchScript", "gather",
        "TotalText, CTW1500, ArT: four sizes and a mixed batch each, by hand", (Run(SPOTTER_RUNS, "| SRFormer R-50 TotalText, CTW1500, ArT |"),)),
    Row("DeepSolo++", "ResNet-50", "stand-in", "TorchScript", "gather",
        "tiny, two scripts: five sizes, a mixed batch, words per script against an independent reading",
        (t("tests/test_deepsolo_plus.py::test_each_query_is_read_in_its_own_script"),), ("deepsolo_plus_tiny",)),
    Row("DeepSolo++", "ResNet-50", "unedited clone", "TorchScript", "gather",
        "MLT19 multi-head: four sizes and a mixed batch, 200 of 200 words its own, by hand",
        (Run(SPOTTER_RUNS, "| DeepSolo++ R-50 MLT19 multi-head |"),)),
    Row("DeepSolo (ReCTS, Chinese)", "ResNet-50", "unedited clone", "TorchScript", "gather",
        "four sizes and a mixed batch, 200 of 200 words its own, by hand",
        (Run(SPOTTER_RUNS, "| DeepSolo R-50 ReCTS (Chinese) |"),)),
    Row("MapTextPipeline (deepsolo)", "ViTAEv2-S", "unedited clone", "TorchScript", "gather",
        "the plain command: multiples of 32 found, four sizes and a mixed batch, 600 of 600 words its own, by hand",
        (Run(SPOTTER_RUNS, "| MapTextPipeline ViTAEv2-S |"),)),
    # --- detrex DETRs ------------------------------------------------------------------------------------------------
    Row("Deformable-DETR (detrex)", "ResNet-50", "stand-in", "TorchScript", "gather",
        "tiny: five sizes, a mixed batch, lint", (t(DETR),), ("deformable_detr_tiny",)),
    Row("Deformable-DETR (detrex)", "ResNet-50", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo("Deformable-DETR (`deformable_detr_tiny`)")),
    Row("DINO (detrex)", "ResNet-50", "stand-in", "TorchScript", "gather", "tiny: five sizes, a mixed batch, lint",
        (t(DETR),), ("dino_tiny",)),
    Row("DINO (detrex)", "ResNet-50", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo("detrex DINO (`dino_tiny`)")),
    Row("DINO (detrex)", "ResNet-50", "stand-in", "torch.export", "fused",
        "tiny: default sizes, a batch, lint and below its minimums",
        (t("tests/test_dynamo_families.py::test_the_family_exports_through_torch_export_verified"),), ("dino_tiny",)),
    Row("DINO (detrex)", "ViTDet (detectron2's `ViT`)", "stand-in", "TorchScript", "gather",
        "four sizes and a mixed batch",
        (t("tests/test_vit_backbone.py::test_dino_on_vitdet_exports_verified_at_sizes_and_a_mixed_batch"),),
        ("dino_vitdet_tiny",)),
    Row("DINO (detrex)", "ViTDet (detectron2's `ViT`)", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo(DINO_TINY_BACKBONES)),
    Row("DINO (detrex)", "ViTDet (detectron2's `ViT`)", "unedited clone", "TorchScript", "gather",
        "depth 4: four sizes and a mixed batch, by hand",
        clone("detrex `dino-vitdet/dino_vitdet_base_4scale_12ep.py`")),
    Row("DINO (detrex)", "ConvNeXt", "stand-in", "TorchScript", "gather", "five sizes and a mixed batch",
        (t(DINO_BACKBONES),), ("dino_convnext_tiny",)),
    Row("DINO (detrex)", "ConvNeXt", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo(DINO_TINY_BACKBONES)),
    Row("DINO (detrex)", "ConvNeXt", "unedited clone", "TorchScript", "gather",
        "depths 1: four sizes and a mixed batch, by hand",
        clone("`dino-convnext/dino_convnext_tiny_384_4scale_12ep.py`")),
    Row("DINO (detrex)", "FocalNet", "stand-in", "TorchScript", "gather", "five sizes and a mixed batch",
        (t(DINO_BACKBONES),), ("dino_focalnet_tiny",)),
    Row("DINO (detrex)", "FocalNet", "stand-in", "torch.export", "gather", "tiny, by hand",
        dynamo(DINO_TINY_BACKBONES)),
    Row("DINO (detrex)", "FocalNet", "unedited clone", "TorchScript", "gather",
        "depths 1: four sizes and a mixed batch, by hand",
        clone("`dino-focal/dino_focal_tiny_lrf_fl3_4scale_12ep.py`")),
    Row("DINO (detrex)", "Swin-L (detectron2's copy)", "unedited clone", "TorchScript", "gather",
        "depths 2: five sizes and a mixed batch, by hand",
        clone("detrex `projects/dino/configs/dino-swin/dino_swin_large_384_4scale_12ep.py`")),
    Row("DINO (detrex)", "InternImage-T (DCNv3)", "unedited clone", "TorchScript", "gather",
        "depths 1: four sizes and a mixed batch, by hand",
        clone("`dino-internimage/dino_internimage_tiny_4scale_12ep.py`")),
    # --- Mask2Former and the segmenters on its pixel decoder --------------------------------------------------------
    Row("Mask2Former", "ResNet-50", "stand-in", "TorchScript", "gather",
        "tiny: default sizes and a batch; also `export.postprocess=graph` (two sizes and a batch)",
        (t("tests/test_mask2former.py::test_the_unedited_model_is_recognised_and_exports_verified"),
         t("tests/test_mask2former.py::test_post_processing_in_the_graph_is_verified_and_serves_the_default_results")),
        ("mask2former_tiny",)),
    Row("Mask2Former", "ResNet-50", "stand-in", "torch.export", "gather",
        "tiny (one encoder, one decoder layer): two sizes and a batch, lint",
        (t("tests/test_dynamo_mask2former.py::test_the_tiny_mask2former_exports_through_torch_export_verified"),),
        ("mask2former_tiny",)),
    Row("Mask2Former", "Swin (detectron2's copy as `D2SwinTransformer`)", "stand-in", "TorchScript", "gather",
        "windows 7 and 12: up to five sizes and a batch; a batch of three against the model's own forward",
        (t("tests/test_swin_backbone.py::test_mask2former_on_swin_exports_verified_at_sizes_and_batches"),),
        ("mask2former_swin_tiny",)),
    Row("Mask2Former", "Swin (detectron2's copy as `D2SwinTransformer`)", "stand-in", "torch.export", "gather",
        "tiny, by hand", dynamo("Mask2Former Swin-T (`mask2former_swin_tiny`)")),
    Row("Mask2Former", "Swin-T, Swin-L (Mask2Former's `D2SwinTransformer`)", "unedited clone", "TorchScript",
        "gather", "depths 2: five sizes and a mixed batch each, by hand",
        clone("Mask2Former `coco/panoptic-segmentation/swin/maskformer2_swin_tiny_bs16_50ep.yaml`",
              "Mask2Former `.../swin/maskformer2_swin_large_IN21k_384_bs16_100ep.yaml`")),
    Row("OneFormer", "ResNet-50", "unedited clone", "TorchScript", "gather",
        "full R-50: the TorchScript graph of the same recorded run (export step, latency)",
        dynamo(ONEFORMER_MASKDINO_R50)),
    Row("OneFormer", "ResNet-50", "unedited clone", "torch.export", "gather",
        "full R-50: four sizes and a mixed batch, by hand", dynamo(ONEFORMER_MASKDINO_R50)),
    Row("OneFormer", "Swin-T (OneFormer's `D2SwinTransformer`)", "unedited clone", "TorchScript", "gather",
        "depths 2: four sizes and a mixed batch, by hand",
        clone("OneFormer `ade20k/swin/oneformer_swin_tiny_bs16_160k.yaml`")),
    Row("OneFormer", "ConvNeXt-L (OneFormer's `D2ConvNeXt`)", "unedited clone", "TorchScript", "gather",
        "depths 1: four sizes and a mixed batch, by hand",
        clone("OneFormer `ade20k/convnext/oneformer_convnext_large_bs16_160k.yaml`")),
    Row("MaskDINO", "ResNet-50", "unedited clone", "TorchScript", "gather",
        "full R-50, panoptic and instance configs: the TorchScript graph of the same recorded run",
        dynamo(ONEFORMER_MASKDINO_R50)),
    Row("MaskDINO", "ResNet-50", "unedited clone", "torch.export", "gather",
        "full R-50, panoptic and instance configs: four sizes and a mixed batch, by hand",
        dynamo(ONEFORMER_MASKDINO_R50)),
    Row("MaskDINO", "Swin-L (MaskDINO's `D2SwinTransformer`)", "unedited clone", "TorchScript", "gather",
        "depths 2: four sizes and a mixed batch, by hand",
        clone("MaskDINO `coco/panoptic-segmentation/swin/maskdino_R50_bs16_50ep_4s_dowsample1_2048.yaml`")),
    Row("MaskDINO", "Swin-L (MaskDINO's `D2SwinTransformer`)", "unedited clone", "torch.export", "gather",
        "depths 2, by hand: verified on an AVX2 EPYC; refused at one size (397x377) on an AVX-512 Xeon",
        dynamo("MaskDINO Swin-L (")),
    # --- detectron2's own model zoo (no deformable attention) ------------------------------------------------------
    Row("Faster R-CNN", "ResNet-18 FPN", "detectron2", "TorchScript", "—", "default sizes (batch fixed at 1)",
        (t("tests/test_export_pipeline.py::test_plain_rcnn_exports_unchanged_with_plugin_active"),), ("rcnn",)),
    Row("Faster R-CNN, Mask R-CNN", "ResNet-18 FPN", "detectron2", "torch.export", "—",
        "five sizes whose detection counts differ, by hand",
        dynamo("detectron2's RetinaNet, Faster / Mask R-CNN, Panoptic FPN")),
    Row("Mask R-CNN, Keypoint R-CNN", "ResNet-18 FPN", "detectron2", "TorchScript", "—",
        "a size and its transpose (batch fixed at 1)", (t(ZOO),), ("rcnn",)),
    Row("RetinaNet", "ResNet-18 FPN", "detectron2", "TorchScript", "—", "a size and its transpose (batch fixed at 1)",
        (t(ZOO),), ("rcnn",)),
    Row("RetinaNet", "ResNet-18 FPN", "detectron2", "torch.export", "—", "five or more sizes, differing counts",
        (t(f"{DYNAMO_D2}::test_retinanet_exports_through_torch_export_verified_at_counts_it_never_traced"),),
        ("rcnn",)),
    Row("Panoptic FPN", "ResNet-18 FPN", "detectron2", "TorchScript", "—",
        "a size and its transpose (batch fixed at 1)",
        (t(ZOO),), ("rcnn",)),
    Row("Panoptic FPN", "ResNet-18 FPN", "detectron2", "torch.export", "—", "five or more sizes, differing counts",
        (t(f"{DYNAMO_D2}::test_panoptic_fpn_exports_through_torch_export_verified_at_counts_it_never_traced"),),
        ("rcnn",)),
    Row("Cascade R-CNN (the box fixture)", "ResNet FPN", "detectron2", "TorchScript", "—",
        "trained weights: default cases",
        (t("tests/test_box_fixture.py::test_export_verifies_with_the_trained_weights"),), ("boxdet",)),
    Row("Cascade R-CNN (the box fixture)", "ResNet FPN", "detectron2", "torch.export", "—", "4 cases, by hand",
        dynamo("detectron2's Cascade R-CNN (`boxdet`)")),
    # --- a backbone alone, exported by torch.onnx in the test, against its own eager code ---------------------------
    Row("(backbone alone)", "Swin (detectron2's copy)", "detectron2", "TorchScript", "—",
        "windows 7 and 12: seven sizes and batches of 1-3",
        (t("tests/test_swin_backbone.py::test_exported_backbone_matches_upstream_at_every_size_and_batch"),)),
    Row("(backbone alone)", "Swin (detectron2's copy, two stages)", "detectron2", "torch.export", "—",
        "four sizes, batches of 1 and 3",
        (t("tests/test_swin_backbone.py::test_torch_export_traces_the_patched_backbone_size_generally"),)),
    Row("(backbone alone)", "ViT (detectron2's)", "detectron2", "TorchScript", "—", "several sizes and batches",
        (t("tests/test_vit_backbone.py::test_exported_vit_matches_upstream_at_every_size_and_batch"),)),
    Row("(layer alone)", "DCNv3 (the detrex stand-in's)", "stand-in", "TorchScript", "—",
        "four sizes, batches of 1-3",
        (t("tests/test_dcnv3.py::test_the_stand_ins_dcnv3_imports_runs_and_exports_at_any_size_and_batch"),)),
)

# Refused in one line, by design (what is refused, and what shows it)
REFUSED: tuple[Row, ...] = (
    Row("OneFormer", "DiNAT", "stand-in", "any", "—", "natten's compiled attention: refused when built",
        (t("tests/test_swin_backbone.py::test_dinat_is_refused_in_one_line_naming_why_and_what_serves"),)),
    Row("Keypoint R-CNN", "ResNet FPN", "detectron2", "torch.export", "—",
        "`keypoints-from-heatmaps`: ROI resizes to sizes read from box values", dynamo("| Keypoint R-CNN |")),
)

# Claimed before, or easy to assume, and not shown: said here so that nobody reads the table's silence as a yes
NOT_SHOWN = (
    "InternImage (DCNv3) through torch.export: never run; TorchScript only.",
    "torch.export on the other unedited clones (detrex's Swin, ViTDet, ConvNeXt, FocalNet, InternImage; "
    "Mask2Former's and OneFormer's Swin; OneFormer's ConvNeXt; DeepSolo's Swin): never run. Recorded: OneFormer and "
    "MaskDINO R-50, MaskDINO Swin-L, DeepSolo ViTAEv2-S.",
    "Mask2Former's, OneFormer's, MaskDINO's and AdelaiDet/DeepSolo's own copies of Swin in the suite: the suite "
    "tests detectron2's copy (the code they share line for line); their own copies were run as unedited clones, by "
    "hand.",
    "OneFormer and MaskDINO models in the suite: their clones were run by hand; the suite has MaskDINO's two-stage "
    "proposals (tests/test_maskdino_proposals.py) and its post-processing against the stand-in's transcription "
    "(third_party/maskdino; upstream's own `maskdino/maskdino.py` only where `MASKDINO_SRC` names a checkout: "
    "tests/test_maskdino_postprocess.py).",
    "The `grid_sample` sampler beyond the tiny TESTR, and `pytorch` / `trt_plugin` in a whole model: the operator "
    "alone (tests/test_msda.py).",
    "TESTR, DPText-DETR, DeepSolo R-50, Mask2Former R-50 and detrex DINO R-50 from unedited clones: the commands are "
    "in exporting.md, no run is recorded in its tables (the stand-ins keep upstream's layout and state dicts).",
)


# ----------------------------------------------------------------------------------------------------- checking
def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, list[str]]:
    """Each heading's text → the table rows ('|' lines) under it, up to the next heading of its level or above."""
    out: dict[str, list[str]] = {}
    open_: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = re.match(r"^(#{1,6}) (.*)$", line)
        if m:
            level = len(m.group(1))
            open_ = [(lv, h) for lv, h in open_ if lv < level] + [(level, m.group(2).strip())]
            out.setdefault(m.group(2).strip(), [])
        elif line.startswith("|"):
            for _, h in open_:
                out[h].append(line)
    return out


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _source(text: str, node: ast.AST) -> str:
    parts = [ast.get_source_segment(text, d) or "" for d in getattr(node, "decorator_list", [])]
    return "\n".join(parts + [ast.get_source_segment(text, node) or ""])


def test_source(test: Test, root: Path = ROOT) -> tuple[str | None, str]:
    """(what the test runs: its function with its decorators, the fixtures it asks for and the module-level helpers
    it calls, in its file or tests/conftest.py, recursively; None if the function is not there) and the file's
    module-level statements (constants such as config tables)."""
    path = root / test.path
    if not path.is_file():
        return None, ""
    text = path.read_text()
    tree = ast.parse(text)
    scopes = [(text, _functions(tree))]
    conftest = path.parent / "conftest.py"
    if conftest.is_file() and conftest != path:
        ctext = conftest.read_text()
        scopes.append((ctext, _functions(ast.parse(ctext))))
    if test.function not in scopes[0][1]:
        return None, ""
    module = "\n".join(ast.get_source_segment(text, n) or "" for n in tree.body
                       if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    seen, parts, todo = set(), [], [test.function]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for stext, funcs in scopes:
            if name in funcs:
                node = funcs[name]
                parts.append(_source(stext, node))
                todo += [a.arg for a in node.args.args]
                todo += [c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
                break
    return "\n".join(parts), module


def _samplers_named(src: str) -> list[str]:
    return re.findall(r"sampler=([\w,]+)", src)


def _test_problems(row: Row, test: Test, root: Path) -> list[str]:
    src, module = test_source(test, root)
    where = f"{test.path}::{test.function}"
    if src is None:
        return [f"{where}: no such test function"]
    out = []
    dynamo_markers = ("exporter=dynamo", "exporter=auto", "dynamo=True")
    if row.route == "torch.export" and not any(m in src for m in dynamo_markers):
        out.append(f"{where}: does not export through torch.export (no {' / '.join(dynamo_markers)})")
    if row.route == "TorchScript" and any(m in src for m in ("exporter=dynamo", "dynamo=True")):
        out.append(f"{where}: exports through torch.export, the row says TorchScript")
    named = _samplers_named(src)
    if row.sampler in ("fused", "grid_sample") and not any(row.sampler in s.split(",") for s in named):
        out.append(f"{where}: does not ask for export.sampler={row.sampler}")
    if row.sampler == "gather" and any("gather" not in s.split(",") for s in named):
        out.append(f"{where}: asks for another sampler than gather ({named})")
    if row.configs and not any(re.search(rf"[\"'\[]{re.escape(c)}[\"'\],]", src + module) for c in row.configs):
        out.append(f"{where}: names none of the configs {row.configs}")
    return out


def _run_problems(row: Row, run: Run, root: Path, cache: dict) -> list[str]:
    if run.doc not in cache:
        path = root / run.doc
        cache[run.doc] = sections(path.read_text()) if path.is_file() else None
    found = cache[run.doc]
    where = f"{run.doc} § {run.section!r}: {run.row!r}"
    if found is None:
        return [f"{run.doc}: no such file"]
    if run.section not in found:
        return [f"{where}: no such heading"]
    lines = [r for r in found[run.section] if run.row in r]
    if len(lines) != 1:
        return [f"{where}: {len(lines)} table rows contain it (one wanted)"]
    line, out = lines[0], []
    if row.route == "torch.export" and "torch.export" not in run.section + line:
        out.append(f"{where}: the row is not a torch.export run")
    if row.route == "TorchScript" and "torch.export" in run.section and "TorchScript" not in line:
        out.append(f"{where}: a torch.export table row that records no TorchScript run")
    named = set(re.findall(r"\b(gather|grid_sample|fused)\b", line))  # words: "refused" names no sampler
    if row.sampler in ("fused", "grid_sample") and row.sampler not in named:
        out.append(f"{where}: the row does not name the {row.sampler} sampler")
    if row.sampler == "gather" and named and "gather" not in named:
        out.append(f"{where}: the row names another sampler than gather")
    return out


def problems(rows=None, root: Path = ROOT) -> list[str]:
    """Everything wrong with `rows` (default: ROWS and REFUSED): missing evidence, unknown values, cited tests that
    are not there or do not do what the row says, cited doc rows that are gone or say another route or sampler."""
    rows = ROWS + REFUSED if rows is None else rows
    out, cache, keys = [], {}, set()
    for row in rows:
        name = f"{row.family} / {row.backbone} / {row.code} / {row.route} / {row.sampler}"
        if name in keys:
            out.append(f"{name}: listed twice")
        keys.add(name)
        if row.route not in ROUTES or row.sampler not in SAMPLERS or row.code not in CODES:
            out.append(f"{name}: route, sampler or code not one of {ROUTES}, {SAMPLERS}, {CODES}")
        if not row.evidence:
            out.append(f"{name}: no evidence (a test of the suite or a recorded run)")
        for ev in row.evidence:
            if isinstance(ev, Test):
                out += [f"{name}: {p}" for p in _test_problems(row, ev, root)]
            elif isinstance(ev, Run):
                out += [f"{name}: {p}" for p in _run_problems(row, ev, root, cache)]
            else:
                out.append(f"{name}: evidence {ev!r} is neither a Test nor a Run")
    return out


# ----------------------------------------------------------------------------------------------------- writing
def _table(rows) -> list[str]:
    lines = ["| family | backbone | model code | route | sampler | shown | evidence |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cites = "<br>".join(ev.cite() for ev in r.evidence)
        lines.append(f"| {r.family} | {r.backbone} | {r.code} | {r.route} | {r.sampler} | {r.shown} | {cites} |")
    return lines


def render() -> str:
    tests = sum(isinstance(ev, Test) for r in ROWS for ev in r.evidence)
    runs = sum(isinstance(ev, Run) for r in ROWS for ev in r.evidence)
    lines = [
        "# What has been shown to export",
        "",
        "<!-- written by scripts/support_table.py from its ROWS: edit those, then run it -->",
        "",
        "Each row is a combination that was exported and verified against eager PyTorch (onnxruntime, seeded weights",
        "unless said), with what shows it: a test of the suite, or a run recorded in a table of",
        "[exporting.md](exporting.md) (unedited clones and tiny configs exported by hand, with the figures they gave).",
        "A combination not listed has not been shown, which is not to say it fails. How this is checked:",
        "`tests/test_support_table.py` fails when this file differs from what `scripts/support_table.py` writes, when",
        "a row has no evidence, when a cited test function is missing or does not ask for the row's route, sampler",
        "and config, and when a cited row of exporting.md is gone or names another route or sampler.",
        "",
        "Route: TorchScript is `export.exporter=torchscript` (the default), torch.export is `export.exporter=dynamo`",
        "(or `auto` where TorchScript fails); *any*: refused whatever the route. Sampler: `export.sampler`",
        "(`gather` the default); — for models without deformable attention. Model code: *stand-in*, the project's",
        "`third_party/` code in upstream's layout; *unedited clone*, upstream's repository as cloned (depths thinned",
        "as exporting.md records); *detectron2*, the installed detectron2's own code. All on the CPU; on CUDA see",
        "[gpu.md](gpu.md) (the fused operator's CUDA kernel gave the CPU kernel's bits on an H200, 2026-12-04:",
        "`benchmarks/msda_cuda_parity.py`).",
        "",
        f"{len(ROWS)} combinations, {tests} citations of tests, {runs} of recorded runs.",
        "",
        *_table(ROWS),
        "",
        "## Refused, by design",
        "",
        *_table(REFUSED),
        "",
        "## Not shown",
        "",
        *[f"- {s}" for s in NOT_SHOWN],
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/support.md is stale or a row is wrong")
    args = parser.parse_args(argv)
    found = problems()
    for p in found:
        print(f"support table: {p}", file=sys.stderr)
    if found:
        return 1
    path = ROOT / OUTPUT
    text = render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"support table: {OUTPUT} is stale: run scripts/support_table.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {OUTPUT} ({len(ROWS)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
