"""detectron2's own RetinaNet through torch.export (export.exporter=dynamo), one image per run as through TorchScript.

Its per-image code tests data-dependent counts in Python (ImageList's padding by sizes as tensors, `min(count, k)`
of the level's candidates, Boxes' `numel() == 0`, Instances' `len()` checks, torchvision's NMS choice by `numel()`);
the export-only patches in d2export/patching/zoo.py compute the same without the tests. The independent side is
detectron2's own eager inference (verification); few candidates per level make the detection count differ between
the verification's sizes, so a graph that baked the traced count would fail."""
from __future__ import annotations

import torch

from d2export import pipeline
from d2export.config import load
from d2export.patching import apply_patches
from exports import export

RETINANET = ("model.d2_config=COCO-Detection/retinanet_R_50_FPN_1x.yaml",
             "model.opts=[MODEL.RESNETS.DEPTH,18,MODEL.RESNETS.RES2_OUT_CHANNELS,64,"
             "MODEL.RETINANET.TOPK_CANDIDATES_TEST,12]")
EXPORT_ONLY = ["image-list-for-torch-export", "dense-inference-for-torch-export"]


def test_retinanet_exports_through_torch_export_verified_at_counts_it_never_traced(tmp_path):
    manifest = export("rcnn", tmp_path, *RETINANET, "export.exporter=dynamo", "export.lint=false")
    v = manifest.verification
    assert manifest.family == "retinanet" and manifest.exporter == "dynamo" and v["passed"] is True
    counts = {c["case"]: c["shape"][1] for c in v["cases"] if c["output"] == "scores"}
    assert len(counts) >= 5 and len(set(counts.values())) >= 2, counts  # the detections' count follows the data
    hits = {p["name"]: p["hits"] for p in manifest.patches}
    assert all(hits[name] for name in EXPORT_ONLY), hits


def test_the_export_only_patches_leave_eager_detectron2_as_it_is(tmp_path):
    built = pipeline.prepare(load("rcnn", [f"export.output_dir={tmp_path}", *RETINANET]))
    g = torch.Generator().manual_seed(4)
    image = torch.randint(0, 255, (3, 150, 210), generator=g).float()
    with torch.no_grad():
        want = built.model([{"image": image}])[0]["instances"]
        with apply_patches(built.model, target=None, only=EXPORT_ONLY) as report:
            got = built.model([{"image": image}])[0]["instances"]
    assert len(got) == len(want) > 0
    for field in ("pred_boxes", "scores", "pred_classes"):
        a, b = (x.get(field) for x in (got, want))
        assert torch.equal(getattr(a, "tensor", a), getattr(b, "tensor", b)), field
    assert all(r.hits == 0 for r in report.records if r.name in EXPORT_ONLY)  # each deferred to detectron2's own
