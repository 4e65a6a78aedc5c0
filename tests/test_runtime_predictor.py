"""The onnxruntime predictor against the eager PyTorch model (detectron2's DefaultPredictor semantics), its
post-processing, providers and picture decoding; and the runtime's independence from torch."""
from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from d2export.runtime.image_decoding import BadImage, ImageTooLarge, decode_image
from d2export.families._text import bezier_polygon
from d2export.runtime.predictor import Predictor
from d2export.runtime.processing import Prepared
from d2export.runtime.providers import ProviderUnavailable, options_per_provider, resolve_providers

REPO = Path(__file__).resolve().parent.parent
# original sizes: upscaled non-square, downscaled portrait, and one where max_size caps the long edge
SIZES = [(120, 200), (300, 180), (90, 400)]


def expected_text(ids, voc_size: int = 96) -> str:
    """TESTR's vocabulary written out independently: ids 0–94 are ASCII 32–126, 95 is unknown, ≥ 96 no character."""
    return "".join(chr(32 + i) if i < 95 else "口" for i in ids if i < voc_size)


@pytest.fixture(scope="module")
def predictor(tiny_export):
    return Predictor(tiny_export[2], threads=1)


@pytest.fixture(scope="module")
def eager(tiny_export):
    from d2export import pipeline

    return pipeline.prepare(tiny_export[0]).model.eval()


def originals(seed: int = 0) -> list[np.ndarray]:
    """HWC uint8 RGB pictures with structure and noise."""
    from d2export.resizing import synthetic_image

    return [synthetic_image(h, w, seed + i).transpose(1, 2, 0).copy() for i, (h, w) in enumerate(SIZES)]


@torch.no_grad()
def eager_instances(model, manifest, images_rgb: list[np.ndarray]):
    """DefaultPredictor's way: the model's pixel format, detectron2's ResizeShortestEdge, height/width = original;
    several pictures go in one call (detectron2 pads them into one batch, as the predictor does)."""
    from detectron2.data import transforms as T

    pre = manifest.preprocess
    aug = T.ResizeShortestEdge([pre["min_size_test"]] * 2, pre["max_size_test"])
    inputs = []
    for image in images_rgb:
        image = np.ascontiguousarray(image if pre["input_format"] == "RGB" else image[:, :, ::-1])
        resized = aug.get_transform(image).apply_image(image)
        inputs.append({"image": torch.as_tensor(resized.transpose(2, 0, 1).astype(np.float32)),
                       "height": image.shape[0], "width": image.shape[1]})
    return [out["instances"] for out in model(inputs)]


def assert_matches(pred, inst, shape):
    assert (pred.height, pred.width) == shape
    assert len(pred.instances) == len(inst) > 0
    scores = np.array([i.score for i in pred.instances])
    np.testing.assert_allclose(scores, inst.scores.double().numpy(), atol=1e-5, rtol=1e-4)
    assert [i.label for i in pred.instances] == inst.pred_classes.tolist()
    polygons = np.array([np.ravel(i.polygon) for i in pred.instances])
    np.testing.assert_allclose(polygons, inst.polygons.double().numpy(), atol=5e-3, rtol=1e-4)
    # compare texts where every slot's best class wins clearly (random weights give near-ties elsewhere)
    top2 = inst.rec_scores.topk(2, dim=-1).values
    clear = ((top2[..., 0] - top2[..., 1]).min(-1).values > 1e-4).numpy()
    assert clear.sum() >= len(inst) // 2
    for k in np.flatnonzero(clear):
        assert pred.instances[k].text == expected_text(inst.recs[k].tolist())


def test_predictor_matches_eager_model_on_original_sizes(predictor, eager, tiny_export):
    manifest = tiny_export[1]
    # hand the predictor the other pixel format than the model's, so the conversion is exercised too
    fmt = "BGR" if manifest.preprocess["input_format"] == "RGB" else "RGB"
    for image in originals():
        given = image if fmt == "RGB" else image[:, :, ::-1]
        assert_matches(predictor.predict(np.ascontiguousarray(given), format=fmt),
                       eager_instances(eager, manifest, [image])[0], image.shape[:2])


def test_predictor_batch_of_mixed_sizes_matches_eager(predictor, eager, tiny_export):
    """A padded batch matches the eager model given the same pictures together (not one by one: the backbone sees
    the zero padding beyond each picture, in detectron2 as in the graph)."""
    images = originals(seed=10)
    for pred, inst, image in zip(predictor.predict_batch(images), eager_instances(eager, tiny_export[1], images),
                                 images):
        assert_matches(pred, inst, image.shape[:2])


def test_score_threshold_keeps_what_eager_scores_pass(predictor, eager, tiny_export):
    image = originals(seed=20)[0]
    scores = eager_instances(eager, tiny_export[1], [image])[0].scores.numpy()
    threshold = float(np.median(scores))
    kept = predictor.predict(image, score_threshold=threshold)
    np.testing.assert_allclose(sorted(i.score for i in kept.instances), np.sort(scores[scores >= threshold]),
                               atol=1e-5)
    assert 0 < len(kept.instances) < len(scores)
    assert Predictor(tiny_export[2], threads=1, score_threshold=1.1).predict(image).instances == []


def test_postprocess_scales_clips_and_decodes(predictor):
    """Hand-made outputs: one instance passes 0.5; points from a 100x200 input back to a 50x400 original."""
    outputs = {
        "scores": np.array([[0.9, 0.2]], np.float32), "labels": np.zeros((1, 2), np.int64),
        "ctrl_points": np.tile(np.array([[-10.0, 20.0], [50, 30], [100, 40], [250, 120],
                                         [190, 80], [150, 70], [60, 60], [5, -5]], np.float32), (1, 2, 1, 1)),
        "char_ids": np.array([[[33, 96, 34, 95], [0, 0, 0, 0]]]), "char_scores": np.full((1, 2, 4), 0.5, np.float32)}
    outputs["char_scores"][0, 0, :3] = [0.9, 0.1, 0.6]
    outputs["char_scores"][0, 0, 3] = 0.3
    prepared = Prepared(np.zeros((3, 100, 200), np.uint8), height=50, width=400)  # x × 2, y × 0.5
    try:
        poly = predictor.postprocess(outputs, 0, prepared, score_threshold=0.5)
        predictor.post["points"] = "bezier"
        bez = predictor.postprocess(outputs, 0, prepared, score_threshold=0.5)
    finally:
        predictor.post["points"] = "polygon"
    (inst,) = poly.instances
    assert inst.text == "AB口" and inst.score == pytest.approx(0.9)
    assert inst.text_score == pytest.approx((0.9 + 0.6 + 0.3) / 3)
    assert inst.polygon[0] == pytest.approx([-20.0, 10.0]) and inst.polygon[3] == pytest.approx([500.0, 60.0])
    (inst,) = bez.instances
    # the curves' end points (0, 3, 4, 7) clipped to the 100x200 input, then scaled; inner control points free
    assert inst.beziers[0] == pytest.approx([0.0, 10.0]) and inst.beziers[3] == pytest.approx([400.0, 50.0])
    assert inst.beziers[7] == pytest.approx([10.0, 0.0]) and inst.beziers[1] == pytest.approx([100.0, 15.0])
    assert len(inst.polygon) == 20 and inst.polygon[0] == pytest.approx([0.0, 10.0])
    assert inst.polygon[9] == pytest.approx([400.0, 50.0]) and inst.polygon[-1] == pytest.approx([10.0, 0.0])
    d = bez.to_dict()
    assert d["width"] == 400 and "beziers" in d["instances"][0] and "beziers" not in poly.to_dict()["instances"][0]


def test_bezier_polygon_follows_the_cubic():
    ctrl = np.array([[0, 0], [1, 2], [3, 2], [4, 0], [4, 5], [3, 6], [1, 6], [0, 5]], float)
    pts = bezier_polygon(ctrl, samples=5)
    t = 0.5  # midpoint of the top curve: (P0 + 3 P1 + 3 P2 + P3) / 8
    assert pts[2] == pytest.approx((ctrl[0] + 3 * ctrl[1] + 3 * ctrl[2] + ctrl[3]) / 8)
    assert pts[7] == pytest.approx(((1 - t) ** 3 * ctrl[4] + 3 * t * (1 - t) ** 2 * ctrl[5]
                                    + 3 * t * t * (1 - t) * ctrl[6] + t**3 * ctrl[7]))
    assert pts[0] == pytest.approx(ctrl[0]) and pts[4] == pytest.approx(ctrl[3]) and pts[9] == pytest.approx(ctrl[7])


def test_providers_asked_for_but_absent_are_refused_clearly(monkeypatch, tiny_export):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert resolve_providers(["cpu"]) == ["CPUExecutionProvider"]
    with pytest.raises(ProviderUnavailable, match="TensorrtExecutionProvider.*onnxruntime-gpu"):
        Predictor(tiny_export[2], providers=["tensorrt"])
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert resolve_providers(["cuda"]) == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_cuda_serves_float32_without_tf32_unless_asked_and_float16_on_tensor_cores():
    """onnxruntime's CUDA provider would compute in TF32 by default: not what verification compared for a float32
    graph; a float16 graph needs it on for cuDNN's tensor-core engines."""
    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    exact = {"use_tf32": "0", "fuse_conv_bias": "1", "prefer_nhwc": "0"}
    tensor_cores = {"use_tf32": "1", "fuse_conv_bias": "1", "prefer_nhwc": "1"}
    assert options_per_provider([cuda, cpu]) == [exact, {}]
    assert options_per_provider([cuda, cpu], precision="int8") == [exact, {}]
    assert options_per_provider([cuda, cpu], tf32=True) == [tensor_cores, {}]
    assert options_per_provider([cuda, cpu], precision="float16") == [tensor_cores, {}]
    given = [{"device_id": "1", "use_tf32": "1"}]  # the user's own options win, the rest keep the defaults
    assert options_per_provider([cuda, cpu], given=given) == [exact | {"use_tf32": "1", "device_id": "1"}, {}]
    assert options_per_provider(["TensorrtExecutionProvider", cuda, cpu]) == [{}, exact, {}]
    assert options_per_provider([cpu]) == [{}]


def matmul_add_graph(path):
    """x [2, 3, 8] @ W + B: what onnxruntime fuses into Reshape-Gemm-Reshape when the shapes are known."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.random((8, 4), np.float32), "W"),
               numpy_helper.from_array(rng.random(4, np.float32), "B")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def add_layernorm_graph(path) -> None:
    """Add + LayerNormalization over a static hidden size: onnxruntime's SkipLayerNormalization pattern."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = [numpy_helper.from_array(np.ones(8, np.float32), "g"), numpy_helper.from_array(np.zeros(8, np.float32),
                                                                                            "b")]
    nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", "l", 8]) for n in ("x", "skip")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                 ["n", "l", 8])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _optimised_ops(tmp_path, graph, providers) -> tuple[list[str], list[str]]:
    import onnx
    import onnxruntime as ort

    from d2export.runtime.providers import disabled_optimizers, serving_settings

    options = ort.SessionOptions()
    if providers is not None:
        serving_settings(options, providers)
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    options.log_severity_level = 3
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(tmp_path / "optimised.onnx")).graph.node], disabled_optimizers(session)


@pytest.mark.parametrize("providers, off", [
    (["CPUExecutionProvider"], ["MatMulAddFusion", "SkipLayerNormFusion"]),
    (["CUDAExecutionProvider", "CPUExecutionProvider"], ["MatMulAddFusion"])])
def test_serving_sessions_keep_matmul_and_add_apart(tmp_path, providers, off):
    """The optimizers' names and config key as this onnxruntime knows them: the optimised graph (here on the CPU,
    which runs the same transformers) fuses MatMul + Add into Gemm, and Add + LayerNormalization into
    SkipLayerNormalization, by default; a serving session keeps MatMul + Add apart on either provider, and Add +
    LayerNormalization where the CPU alone serves."""
    matmul_add_graph(tmp_path / "mm.onnx")
    add_layernorm_graph(tmp_path / "ln.onnx")
    assert "Gemm" in _optimised_ops(tmp_path, tmp_path / "mm.onnx", None)[0]
    assert "SkipLayerNormalization" in _optimised_ops(tmp_path, tmp_path / "ln.onnx", None)[0]
    ops, disabled = _optimised_ops(tmp_path, tmp_path / "mm.onnx", providers)
    assert ops == ["MatMul", "Add"] and disabled == off
    ops, _ = _optimised_ops(tmp_path, tmp_path / "ln.onnx", providers)
    assert ("SkipLayerNormalization" in ops) is ("SkipLayerNormFusion" not in off)


def test_served_sessions_stop_spinning_when_a_run_returns(tmp_path):
    # onnxruntime's pool threads would spin on after a run, taking the cores from the post-processing that follows
    import onnxruntime as ort

    from d2export.runtime.providers import SPINNING_STOP_KEY, config_entry, serving_settings

    matmul_add_graph(tmp_path / "mm.onnx")
    for providers in (["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]):
        options = ort.SessionOptions()
        serving_settings(options, providers)
        session = ort.InferenceSession(str(tmp_path / "mm.onnx"), options, providers=["CPUExecutionProvider"])
        assert config_entry(session.get_session_options(), SPINNING_STOP_KEY) == "1"
    options = ort.SessionOptions()
    options.add_session_config_entry(SPINNING_STOP_KEY, "0")  # a caller's own choice stays
    serving_settings(options, ["CPUExecutionProvider"])
    assert config_entry(options, SPINNING_STOP_KEY) == "0"


class FakeCudaSession:
    """A CPU session that says it runs on the CUDA provider with the options it was given (onnxruntime's CPU build
    cannot make one)."""

    def __init__(self, session, cuda_options):
        self._session, self._cuda_options = session, cuda_options

    def get_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def get_provider_options(self):
        return {"CUDAExecutionProvider": dict(self._cuda_options), "CPUExecutionProvider": {}}

    def __getattr__(self, name):
        return getattr(self._session, name)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The predictor's sessions as a CUDA machine would build them: each call's CUDA options recorded; `refuse`
    makes onnxruntime refuse CUDA graphs, as it does for a graph with nodes left to the CPU."""
    import onnxruntime as ort

    from d2export.runtime import predictor as module

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    calls, state = [], {"refuse": False}

    def create_session(path, options, providers, provider_options):
        cpu_session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        if "CUDAExecutionProvider" not in providers:
            return cpu_session
        cuda = provider_options[providers.index("CUDAExecutionProvider")]
        calls.append(cuda)
        if state["refuse"] and cuda.get("enable_cuda_graph") == "1":
            raise RuntimeError("This session cannot use the graph capture feature as requested by the user as all "
                               "compute graph nodes have not been partitioned to the CUDA EP.")
        return FakeCudaSession(cpu_session, cuda)

    monkeypatch.setattr(module, "create_session", create_session)
    return calls, state


def test_cuda_graphs_cost_one_session_where_onnxruntime_takes_them(tiny_export, fake_cuda):
    calls, _ = fake_cuda
    served = Predictor(tiny_export[2], providers=["cuda"], threads=1, cuda_graph=True)
    assert len(calls) == 1 and calls[0]["enable_cuda_graph"] == "1"
    assert served.bound is not None and served.bound.device == "cuda"
    meta = served.metadata()
    assert meta["cuda_graph"] is True and meta["disabled_optimizers"] == ["MatMulAddFusion"]
    assert meta["provider_options"]["CUDAExecutionProvider"]["use_tf32"] == "0"  # a float32 graph: exact


def test_cuda_graphs_refused_fall_back_to_the_plain_session(tiny_export, fake_cuda, caplog):
    calls, state = fake_cuda
    state["refuse"] = True
    with caplog.at_level("WARNING", logger="d2export"):
        served = Predictor(tiny_export[2], providers=["cuda"], threads=1, cuda_graph=True)
    assert [c.get("enable_cuda_graph") for c in calls] == ["1", None]
    assert calls[1] == options_per_provider(["CUDAExecutionProvider"])[0]
    assert served.bound is None and served.metadata()["cuda_graph"] is False
    assert "onnxruntime refuses them for this graph (This session cannot use the graph capture" in caplog.text
    assert served.predict(np.full((100, 150, 3), 128, np.uint8)).instances  # the plain session serves


def test_without_cuda_graphs_one_plain_session(tiny_export, fake_cuda, caplog):
    calls, _ = fake_cuda
    Predictor(tiny_export[2], providers=["cuda"], threads=1)
    assert len(calls) == 1 and "enable_cuda_graph" not in calls[0]
    with caplog.at_level("WARNING", logger="d2export"):
        served = Predictor(tiny_export[2], threads=1, cuda_graph=True)  # the CPU alone: nothing to capture
    assert served.bound is None and "they need the CUDA provider" in caplog.text
    assert served.metadata()["disabled_optimizers"] == ["MatMulAddFusion", "SkipLayerNormFusion"]


def test_the_predictor_reports_the_providers_it_really_runs_on(tiny_export, monkeypatch):
    served = Predictor(tiny_export[2], threads=1)
    assert served.metadata()["providers"] == ["CPUExecutionProvider"]
    assert "CPUExecutionProvider" in served.metadata()["provider_options"]
    assert served.providers_line() == "running on CPUExecutionProvider"
    # onnxruntime drops a provider it cannot load without an error: the line says so
    monkeypatch.setattr(served, "providers", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert served.providers_line().endswith("not available: CUDAExecutionProvider")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a size and carries no pixel data: for zero-size and decompression-bomb cases."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def encoded(image: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, fmt)
    return buf.getvalue()


def test_decode_image_reads_good_pictures_and_names_bad_ones():
    image = originals()[0]
    assert np.array_equal(decode_image(encoded(image)), image)
    grey = decode_image(encoded(image[:, :, 0]))
    assert grey.shape == image.shape and np.array_equal(grey[:, :, 2], image[:, :, 0])
    png = encoded(image)
    cases = {b"": "empty", b"GIF89a not really": "not an image", png[: len(png) // 2]: "truncated",
             png_header_only(0, 0): "not an image", png_header_only(20000, 20000): "limit"}
    for data, words in cases.items():
        with pytest.raises(BadImage, match=words):
            decode_image(data)
    with pytest.raises(ImageTooLarge):
        decode_image(png_header_only(20000, 20000))
    with pytest.raises(ImageTooLarge):
        decode_image(png, max_pixels=100)


BLOCK_TORCH = ("import sys\n"
               "for name in ('torch', 'torchvision', 'detectron2'): sys.modules[name] = None  # import fails\n")


def test_runtime_imports_and_predicts_without_torch(tiny_export):
    code = BLOCK_TORCH + (
        "import numpy as np\n"
        "import d2export.runtime as rt\n"
        "import d2export.runtime.server, d2export.runtime.triton, d2export.runtime.infer, d2export.runtime.visualize\n"
        "import d2export.runtime.batch, d2export.runtime.triton_python\n"
        "import d2export.runtime.providers, d2export.runtime.processing, d2export.runtime.model_loading\n"
        "import d2export.runtime.serving_arguments\n"
        "import d2export.cli\n"
        "from d2export import families; assert families.families()  # every family module's top level\n"
        f"p = rt.Predictor({str(tiny_export[2])!r}, threads=1)\n"
        "r = p.predict(np.full((100, 150, 3), 128, np.uint8))\n"
        "assert (r.height, r.width) == (100, 150) and r.instances\n"
        "assert not any(m.startswith(('torch', 'detectron2')) and sys.modules[m] is not None for m in sys.modules)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_pictures_below_the_graphs_least_size_are_padded_up_to_it(tiny_export):
    """Where torch.export narrowed a graph to a least size and it answered differently below (the export's lint),
    the manifest says so and the runtime pads smaller pictures up to it, their own sizes kept for the results."""
    import dataclasses

    from d2export.runtime.processing import Processing

    _, manifest, _ = tiny_export
    narrowed = dataclasses.replace(manifest, preprocess=manifest.preprocess | {"min_input_size": [97, 65]})
    plain, padded = Processing(manifest, min_size=40, max_size=300), Processing(narrowed, min_size=40, max_size=300)
    wide, tall = (np.full((40, 300, 3), 90, np.uint8), np.full((200, 40, 3), 90, np.uint8))
    for processing, shape in ((plain, (1, 3, 40, 300)), (padded, (1, 3, 97, 300))):
        feeds = processing.feeds([processing.prepare(wide)])
        assert feeds["images"].shape == shape and feeds["image_sizes"].tolist() == [[40, 300]]
    feeds = padded.feeds([padded.prepare(wide), padded.prepare(tall)])
    assert feeds["images"].shape == (2, 3, 200, 300) and feeds["image_sizes"].tolist() == [[40, 300], [200, 40]]
    small = padded.feeds([padded.prepare(np.full((40, 40, 3), 90, np.uint8))])
    assert small["images"].shape == (1, 3, 97, 65) and not small["images"][0, :, 40:].any()  # zeros below
