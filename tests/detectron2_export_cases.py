"""detectron2's own export tests (tests/test_export_torchscript.py, tests/test_export_onnx.py upstream), redone
offline: small zoo configs with seeded random weights and synthetic images instead of trained COCO models.

Run as a script, it runs every case in a fresh process and saves each outcome (the outputs, or the error) for
tests/test_detectron2_exports.py to compare; `--plugin` runs them with d2export activated and the export patch
scope open from before detectron2 is imported (so also detectron2's import-time scripting happens inside it).
This module must not import d2export: the reference run has never seen it.
"""
from __future__ import annotations

import argparse
import io
import sys
import time
import traceback

import torch
from torch import Tensor, nn

CASES = {}
# Cases that fail without the plugin too: the comparison then asks for the same error.
FAIL_WITHOUT_PLUGIN = {"script_batched_nms_rotated",  # detectron2 is installed without its compiled _C here
                       "export_paste_masks"}  # data-dependent chunk sizes
SIZE, OTHER = (128, 192), (160, 96)  # trace/export size and a run size (non-square, other aspect)


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def image(seed: int, size=SIZE) -> Tensor:
    return torch.rand(3, *size, generator=torch.Generator().manual_seed(seed)) * 255


def build(zoo_config: str):
    """A zoo config shrunk for speed (R-18, narrow FPN and heads), every score kept, seeded random weights."""
    from detectron2 import model_zoo
    from detectron2.config import get_cfg
    from detectron2.modeling import build_model

    cfg = get_cfg()
    cfg.merge_from_file(model_zoo.get_config_file(zoo_config))
    cfg.MODEL.DEVICE, cfg.MODEL.WEIGHTS = "cpu", ""
    cfg.MODEL.RESNETS.DEPTH, cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 18, 64
    cfg.MODEL.FPN.OUT_CHANNELS = 32
    cfg.MODEL.ROI_BOX_HEAD.FC_DIM, cfg.MODEL.ROI_MASK_HEAD.CONV_DIM = 64, 16
    cfg.MODEL.RPN.PRE_NMS_TOPK_TEST, cfg.MODEL.RPN.POST_NMS_TOPK_TEST = 300, 60
    cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST = 0.0  # random weights score ~1/81: keep detections to compare
    cfg.MODEL.RETINANET.NUM_CONVS, cfg.MODEL.RETINANET.SCORE_THRESH_TEST = 1, 0.0
    cfg.MODEL.RETINANET.TOPK_CANDIDATES_TEST = 60
    cfg.TEST.DETECTIONS_PER_IMAGE = 15
    torch.manual_seed(0)
    return build_model(cfg).eval()


def fields(instances, prefix: str) -> dict:
    from detectron2.structures import Boxes, Instances
    from detectron2.utils.testing import convert_scripted_instances

    if not isinstance(instances, Instances):
        instances = convert_scripted_instances(instances)
    out = {f"{prefix}.image_size": torch.as_tensor(instances.image_size)}
    for name, value in instances.get_fields().items():
        out[f"{prefix}.{name}"] = value.tensor if isinstance(value, Boxes) else value
    return out


# ---------------------------------------------------------------------------------------------- TestScripting
RCNN_FIELDS = ("proposal_boxes", "objectness_logits", "pred_boxes", "scores", "pred_classes", "pred_masks")


def _script(model, names):
    from detectron2.export import scripting_with_instances
    from detectron2.structures import Boxes

    return scripting_with_instances(model, {n: Boxes if n.endswith("boxes") else Tensor for n in names})


@case
def script_mask_rcnn_fpn():
    from detectron2.utils.testing import assert_instances_allclose

    model = build("COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_3x.yaml")
    scripted = _script(model, RCNN_FIELDS)
    inputs = [{"image": image(0)}, {"image": image(1, OTHER)}]
    with torch.no_grad():
        eager = model.inference(inputs, do_postprocess=False)[0]
        out = scripted.inference(inputs, do_postprocess=False)[0]
    assert_instances_allclose(eager, out)
    return fields(eager, "eager") | fields(out, "scripted")


@case
def script_retinanet():
    from detectron2.modeling.postprocessing import detector_postprocess
    from detectron2.utils.testing import assert_instances_allclose, convert_scripted_instances

    model = build("COCO-Detection/retinanet_R_50_FPN_3x.yaml")
    scripted = _script(model, ("pred_boxes", "scores", "pred_classes"))
    img = image(2)
    with torch.no_grad():
        eager = model([{"image": img}] * 2)[0]["instances"]
        out = detector_postprocess(convert_scripted_instances(scripted([{"image": img}] * 2)[0]), *img.shape[1:])
    assert_instances_allclose(eager, out)
    return fields(eager, "eager") | fields(out, "scripted")


# ------------------------------------------------------------------------------------------------ TestTracing
def _trace_zoo(zoo_config, inference_func):
    from detectron2.export.flatten import TracingAdapter
    from detectron2.utils.testing import assert_instances_allclose

    model = build(zoo_config)
    img = image(3)
    wrapper = TracingAdapter(model, img, inference_func).eval()
    with torch.no_grad():
        small = nn.functional.interpolate(img[None], scale_factor=0.5)[0]  # traced on another size than it runs
        traced = torch.jit.trace(wrapper, (small,))
        eager = inference_func(model, img)
        out = wrapper.outputs_schema(traced(img))
    assert_instances_allclose(eager, out, size_as_tensor=True)
    return fields(eager, "eager") | fields(out, "traced")


@case
def trace_mask_rcnn_fpn():
    return _trace_zoo("COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_3x.yaml",
                      lambda model, img: model.inference([{"image": img}], do_postprocess=False)[0])


@case
def trace_mask_rcnn_fpn_with_postprocess():  # pastes masks: paste_masks_in_image is scripted during the trace
    return _trace_zoo("COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_3x.yaml",
                      lambda model, img: model.inference([{"image": img, "height": img.shape[1] + 9,
                                                           "width": img.shape[2] - 5}])[0]["instances"])


@case
def trace_retinanet():
    return _trace_zoo("COCO-Detection/retinanet_R_50_FPN_3x.yaml",
                      lambda model, img: model([{"image": img}])[0]["instances"])


@case
def trace_keypoint_head():  # heatmaps_to_keypoints is scripted during the trace
    from detectron2.export.torchscript_patch import patch_builtin_len
    from detectron2.layers import ShapeSpec
    from detectron2.modeling.roi_heads import KRCNNConvDeconvUpsampleHead
    from detectron2.structures import Boxes, Instances
    from detectron2.utils.testing import random_boxes

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = KRCNNConvDeconvUpsampleHead(ShapeSpec(channels=4, height=14, width=14), num_keypoints=17,
                                                     conv_dims=(4,))

        def forward(self, x, box1, box2):
            inst = [Instances((100, 120), pred_boxes=Boxes(box1)), Instances((100, 120), pred_boxes=Boxes(box2))]
            return tuple(i.pred_keypoints for i in self.model(x, inst))

    torch.manual_seed(4)
    model = M().eval()

    def gen_input(n1, n2):
        return torch.randn((n1 + n2, 4, 14, 14)), random_boxes(n1), random_boxes(n2)

    with torch.no_grad(), patch_builtin_len():
        trace = torch.jit.trace(model, gen_input(15, 15), check_trace=False)
        inputs = gen_input(12, 7)
        traced, eager = trace(*inputs), model(*inputs)
    assert all(torch.allclose(t, e) for t, e in zip(traced, eager))
    return {f"traced.{i}": t for i, t in enumerate(traced)} | {f"eager.{i}": e for i, e in enumerate(eager)}


@case
def trace_backbone():  # test_dump_IR_tracing's model, run at another size and batch
    from detectron2.config import get_cfg
    from detectron2.modeling import build_backbone

    cfg = get_cfg()
    cfg.MODEL.RESNETS.DEPTH, cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 18, 64

    class Mod(nn.Module):
        def forward(self, x):
            return tuple(self.m(x).values())

    torch.manual_seed(5)
    model = Mod()
    model.m = build_backbone(cfg)
    model.eval()
    x = torch.rand(1, 3, *OTHER, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        traced = torch.jit.trace(model, (torch.rand(2, 3, *SIZE),))
        out, eager = traced(x), model(x)
    assert all(torch.allclose(a, b) for a, b in zip(out, eager))
    return {f"traced.{i}": t for i, t in enumerate(out)} | {f"eager.{i}": e for i, e in enumerate(eager)}


# ---------------------------------------------------------------------------------- detectron2's scripted helpers
def _script_helper(fn, *args):
    scripted = torch.jit.script(fn)  # script_if_tracing wrappers script their original function
    out, eager = scripted(*args), fn(*args)
    out, eager = (out, eager) if isinstance(out, tuple) else ((out,), (eager,))
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
    return {f"scripted.{i}": t for i, t in enumerate(out)} | {f"eager.{i}": e for i, e in enumerate(eager)}


@case
def script_paste_masks_in_image():
    from detectron2.layers.mask_ops import paste_masks_in_image
    from detectron2.utils.testing import random_boxes

    torch.manual_seed(7)
    return _script_helper(paste_masks_in_image, torch.rand(6, 28, 28), random_boxes(6, 90), (81, 97), 0.5)


@case
def script_heatmaps_to_keypoints():
    from detectron2.structures.keypoints import heatmaps_to_keypoints
    from detectron2.utils.testing import random_boxes

    torch.manual_seed(8)
    return _script_helper(heatmaps_to_keypoints, torch.randn(5, 17, 14, 14), random_boxes(5, 90))


@case
def script_pooler_helpers():
    from detectron2.modeling.poolers import _convert_boxes_to_pooler_format, assign_boxes_to_levels
    from detectron2.structures import Boxes
    from detectron2.utils.testing import random_boxes

    torch.manual_seed(9)
    boxes = random_boxes(7, 400)
    out = _script_helper(_convert_boxes_to_pooler_format, boxes, torch.tensor([3, 4]))
    levels = assign_boxes_to_levels([Boxes(boxes[:3]), Boxes(boxes[3:])], 2, 5, 224, 4)
    return out | {"levels": levels}


@case
def script_batched_nms_rotated():
    from detectron2.layers.nms import batched_nms_rotated

    boxes = torch.rand(6, 5) * torch.tensor([50.0, 50, 20, 20, 90])
    return _script_helper(batched_nms_rotated, boxes, torch.rand(6), torch.tensor([0, 1, 0, 1, 0, 1]), 0.5)


@case
def script_box2box_transform():  # a class scripted when detectron2 is imported
    from detectron2.modeling.box_regression import Box2BoxTransform
    from detectron2.utils.testing import random_boxes

    torch.manual_seed(10)
    t = Box2BoxTransform((10.0, 10.0, 5.0, 5.0))
    src, dst = random_boxes(9, 100), random_boxes(9, 100)
    deltas = t.get_deltas(src, dst)
    return {"deltas": deltas, "applied": t.apply_deltas(deltas, src)}


# --------------------------------------------------------------------------------------- TestONNXTracingExport
def _onnx_zoo(zoo_config, inference_func, opset=14):
    """Export with detectron2's TracingAdapter and the TorchScript-based exporter, as upstream does (plus dynamic
    H, W), then run onnxruntime at the export size and at another one."""
    import onnx
    import onnxruntime as ort
    from detectron2.export.flatten import TracingAdapter

    model = build(zoo_config)
    adapter = TracingAdapter(model, (image(11),), inference_func).eval()
    f = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(adapter, adapter.flattened_inputs, f, opset_version=opset, dynamo=False,
                          training=torch.onnx.TrainingMode.EVAL,
                          operator_export_type=torch.onnx.OperatorExportTypes.ONNX,
                          input_names=["image"], dynamic_axes={"image": {1: "h", 2: "w"}})
    onnx.checker.check_model(onnx.load_from_string(f.getvalue()))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(f.getvalue(), options, providers=["CPUExecutionProvider"])
    out = {}
    for name, img in (("export_size", image(11)), ("other_size", image(12, OTHER))):
        with torch.no_grad():
            eager = adapter(img)  # the flattened outputs of the model's own inference
        got = session.run(None, {"image": img.numpy()})
        for i, (g, e) in enumerate(zip(got, eager)):
            out[f"{name}.ort.{i}"], out[f"{name}.eager.{i}"] = torch.from_numpy(g), e
    return out


@case
def onnx_faster_rcnn_fpn():
    return _onnx_zoo("COCO-Detection/faster_rcnn_R_50_FPN_3x.yaml",
                     lambda model, img: model.inference([{"image": img}], do_postprocess=False)[0])


@case
def onnx_mask_rcnn_fpn():
    return _onnx_zoo("COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_3x.yaml",
                     lambda model, img: model.inference([{"image": img}], do_postprocess=False)[0])


@case
def onnx_retinanet():
    return _onnx_zoo("COCO-Detection/retinanet_R_50_FPN_3x.yaml",
                     lambda model, img: model.forward([{"image": img}])[0]["instances"])


# ------------------------------------------------------------------------------------------------ torch.export
def _export_and_run(module, args, dynamic_shapes, other_args):
    program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    with torch.no_grad():
        out, eager = program.module()(*other_args), module(*other_args)
    out, eager = (out, eager) if isinstance(out, tuple) else ((out,), (eager,))
    assert all(torch.allclose(a, b) for a, b in zip(out, eager))
    return {f"exported.{i}": t for i, t in enumerate(out)} | {f"eager.{i}": e for i, e in enumerate(eager)}


@case
def export_fpn_backbone():  # torch.export with dynamic batch, H, W; run at another size
    class Backbone(nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.backbone = backbone

        def forward(self, x):
            return tuple(self.backbone(x).values())

    model = Backbone(build("COCO-Detection/faster_rcnn_R_50_FPN_3x.yaml").backbone).eval()
    auto = torch.export.Dim.AUTO
    return _export_and_run(model, (torch.rand(2, 3, *SIZE),), {"x": {0: auto, 2: auto, 3: auto}},
                           (torch.rand(1, 3, *OTHER, generator=torch.Generator().manual_seed(13)),))


@case
def export_paste_masks():  # data-dependent chunking: torch.export refuses it, with or without the plugin
    from detectron2.layers.mask_ops import paste_masks_in_image
    from detectron2.utils.testing import random_boxes

    class Paste(nn.Module):
        def forward(self, masks, boxes):
            return paste_masks_in_image(masks, boxes, (81, 97), 0.5)

    torch.manual_seed(14)
    auto = torch.export.Dim.AUTO
    return _export_and_run(Paste(), (torch.rand(6, 28, 28), random_boxes(6, 90)),
                           {"masks": {0: auto}, "boxes": {0: auto}}, (torch.rand(9, 28, 28), random_boxes(9, 90)))


# -------------------------------------------------------------------------------------------------------- runner
def run_all(names, report=None) -> dict:
    """Each case's outcome; with a patch report, also which patches rewrote calls during it."""
    outcomes = {}
    for name in names:
        fn = CASES[name]
        started = time.perf_counter()
        hits_before = {r.name: r.hits for r in report.records} if report else {}
        try:
            outputs = fn()
            outcome = {"passed": True, "outputs": {k: v.detach().clone() for k, v in outputs.items()}}
        except Exception as e:  # noqa: BLE001 - an outcome to compare, not a reason to stop
            first = (str(e).strip().splitlines() or [""])[0]
            outcome = {"passed": False, "error": f"{type(e).__name__}: {first}", "where": traceback.format_exc()}
        outcome["rewritten_by"] = sorted(r.name for r in report.records if r.hits > hits_before[r.name]) \
            if report else []
        outcomes[name] = outcome | {"seconds": round(time.perf_counter() - started, 2)}
    return outcomes


# With every patch installed, the scripting and tracing cases (TorchScript's view of the patched names, eager code
# through the wrappers); the exports would be rewritten for old opsets by design.
EVERY_PATCH_CASES = [name for name in CASES if name.startswith(("script_", "trace_"))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--plugin", choices=["export-scope", "every-patch"],
                        help="d2export activated and a patch scope open: the export pipeline's (opset 17, "
                             "onnxruntime), or every registered patch installed (target=None)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.plugin:
        import d2export
        from d2export.ops.msda import use_sampler
        from d2export.patching import Target, apply_patches

        d2export.activate()
        target = Target(17, "onnxruntime") if args.plugin == "export-scope" else None
        names = list(CASES) if args.plugin == "export-scope" else EVERY_PATCH_CASES
        with use_sampler("gather"), apply_patches(model=None, target=target) as report:
            outcomes = run_all(names, report)
        outcomes["_report"] = report.to_dict()
    else:
        outcomes = run_all(list(CASES))
        assert "d2export" not in sys.modules, "the reference run must never import d2export"
    torch.save(outcomes, args.output)


if __name__ == "__main__":
    main()
