"""detectron2's own detectors through torch.export (export.exporter=dynamo), one image per run as through TorchScript:
RetinaNet and Panoptic FPN (Faster / Mask R-CNN's path with a semantic head), R-18 backbones of the model zoo's
configs. (Faster and Mask R-CNN alone and the Cascade R-CNN fixture export and verify too, by hand:
docs/exporting.md.)

Their per-image code tests data-dependent counts in Python (ImageList's padding by sizes as tensors, `min(count, k)`,
`if not valid.all()`, Boxes' `numel() == 0` and clip assert, Instances' `len()` checks, torchvision's NMS choice by
`numel()`); the export-only patches in d2export/patching/zoo.py compute the same without the tests. The independent
side is detectron2's own eager inference (verification); few candidates, or many detections allowed, make the
detection count differ between the verification's sizes, so a graph that baked the traced count would fail."""
from __future__ import annotations

import torch

from d2export import pipeline
from d2export.config import load
from d2export.patching import apply_patches
from exports import export

RETINANET = ("model.d2_config=COCO-Detection/retinanet_R_50_FPN_1x.yaml",
             "model.opts=[MODEL.RESNETS.DEPTH,18,MODEL.RESNETS.RES2_OUT_CHANNELS,64,"
             "MODEL.RETINANET.TOPK_CANDIDATES_TEST,12]")
R_18 = "MODEL.RESNETS.DEPTH,18,MODEL.RESNETS.RES2_OUT_CHANNELS,64"
# narrow FPN and heads: the mask head's convolutions on every detection were most of the eager and onnxruntime time
# (the operators, and so torch.export's time, are the same at any width)
NARROW = ("MODEL.FPN.OUT_CHANNELS,32,MODEL.ROI_BOX_HEAD.FC_DIM,64,MODEL.ROI_MASK_HEAD.CONV_DIM,16,"
          "MODEL.SEM_SEG_HEAD.CONVS_DIM,32")
PANOPTIC_FPN = ("model.d2_config=COCO-PanopticSegmentation/panoptic_fpn_R_50_1x.yaml",
                f"model.opts=[{R_18},{NARROW},MODEL.RPN.POST_NMS_TOPK_TEST,3,TEST.DETECTIONS_PER_IMAGE,1000]")
EXPORT_ONLY = ["image-list-for-torch-export", "dense-inference-for-torch-export"]
RCNN_ONLY = ["image-list-for-torch-export", "rpn-proposals-for-torch-export", "roi-pooler-for-torch-export",
             "box-predictions-for-torch-export", "box-probabilities-for-torch-export", "box-inference-for-torch-export"]


def _exported(config, tmp_path, *overrides):
    manifest = export(config, tmp_path, *overrides, "export.exporter=dynamo")
    assert manifest.exporter == "dynamo" and manifest.verification["passed"] is True
    assert manifest.verification["lint"]["clean"] is True  # read off the one capture (test_size_assumptions.py)
    counts = {c["case"]: c["shape"][1] for c in manifest.verification["cases"] if c["output"] == "scores"}
    return manifest, counts, {p["name"]: p["hits"] for p in manifest.patches}


def test_retinanet_exports_through_torch_export_verified_at_counts_it_never_traced(tmp_path):
    manifest, counts, hits = _exported("rcnn", tmp_path, *RETINANET)
    assert manifest.family == "retinanet"
    assert len(counts) >= 5 and len(set(counts.values())) >= 2, counts  # the detections' count follows the data
    assert all(hits[name] for name in EXPORT_ONLY), hits


def test_panoptic_fpn_exports_through_torch_export_verified_at_counts_it_never_traced(tmp_path):
    """Panoptic FPN: Mask R-CNN's path (RPN, pooler, box predictor, per-image inference, masks) and a semantic head."""
    manifest, counts, hits = _exported("rcnn", tmp_path, *PANOPTIC_FPN)
    assert manifest.family == "panoptic_fpn" and {"masks", "sem_seg"} <= {o.name for o in manifest.outputs}
    assert len(counts) >= 5 and len(set(counts.values())) >= 2, counts
    assert all(hits[name] for name in RCNN_ONLY + ["mask-probabilities-for-torch-export"]), hits


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
