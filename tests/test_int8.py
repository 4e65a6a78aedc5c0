"""export.int8: onnxruntime's quantization on the verified float32 graph, with what int8 breaks kept float."""
import numpy as np
import pytest

from d2export.exporting import int8
from d2export.verification.pictures import picture_files
from exports import export

# what text spotters keep float so that the queries a TopK picks from the proposals' scores stay the same
ENCODER_AND_PROPOSALS = ("encoder", "enc_output", "bbox_class_embed", "bezier_class_embed")
# and so that a reader's character probabilities stay within the tolerance
TEXT_BRANCH = ("attn_cross_text", "attn_intra_text", "attn_inter_text", "linear1_text", "linear2_text", "text_class")


def test_scopes_name_modules_by_their_path():
    scopes = ("sampling_offsets", "ctrl_point_coord")
    assert int8.in_scope("/testr/transformer/encoder/layers.0/self_attn/sampling_offsets/MatMul", scopes)
    assert int8.in_scope("/testr/ctrl_point_coord.0/layers.1/MatMul", scopes)  # a ModuleList's item
    assert not int8.in_scope("/testr/transformer/encoder/layers.0/self_attn/value_proj/MatMul", scopes)
    assert not int8.in_scope("/testr/ctrl_point_coordinates/MatMul", scopes)  # another module's name begins alike
    assert not int8.in_scope("sampling_offsets_MatMul", scopes)
    # a module called twice: torch.onnx names its second call's nodes with a suffix
    assert int8.in_scope("/testr/ctrl_point_coord.0_1/layers.1/MatMul", scopes)
    assert int8.in_scope("/testr/text_class_1/MatMul", ("text_class",))
    assert not int8.in_scope("/testr/text_class_x/MatMul", ("text_class",))
    assert not int8.in_scope("/testr/text_classes/MatMul", ("text_class",))


def test_reduce_range_only_where_the_cpu_lacks_vnni():
    assert int8.reduce_range_for(["avx2", "avx512f"])[0] is True
    assert int8.reduce_range_for(["avx2", "avx512f", "avx512_vnni"])[0] is False
    assert int8.reduce_range_for(["avx2", "amx_tile", "amx_int8"])[0] is False
    assert "VNNI" in int8.reduce_range_for(["avx2"])[1]


def test_static_int8_keeps_attention_products_float(tmp_path):
    """onnxruntime's QDQ quantiser would take query-by-key and weights-by-value products (and the softmax between
    them) with the weight MatMuls; static int8 quantises the weight MatMul alone."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["q"], name="/attn/q_proj/MatMul"),
             helper.make_node("Transpose", ["q"], ["k"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "k"], ["logits"], name="/attn/MatMul"),
             helper.make_node("Softmax", ["logits"], ["weights"], axis=-1),
             helper.make_node("MatMul", ["weights", "q"], ["y"], name="/attn/MatMul_1")]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])],
                              [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")])
    src, dst = tmp_path / "float.onnx", tmp_path / "int8.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    assert int8.activation_matmuls(onnx.load(str(src))) == ["/attn/MatMul", "/attn/MatMul_1"]

    class Feeds:  # what the calibrator asks of a reader, a few feeds a range
        def __init__(self):
            self.items, self.at, self.end = [{"x": rng.standard_normal((1, 6, 8)).astype(np.float32)}
                                             for _ in range(4)], 0, 4

        def __len__(self):
            return len(self.items)

        def set_range(self, start_index, end_index):
            self.at, self.end = start_index, min(end_index, len(self.items))

        def get_next(self):
            self.at += 1
            return self.items[self.at - 1] if self.at <= self.end else None

    record = int8.quantize(src, dst, "static", (), ["avx512_vnni"], Feeds(), static_ops=("MatMul",))
    model = onnx.load(str(dst))
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    matmuls = {n.name: n for n in model.graph.node if n.op_type == "MatMul"}
    assert matmuls["/attn/q_proj/MatMul"].input[1] in dequantized  # the weight product is int8
    assert record.quantized == 1 and {"/attn/MatMul", "/attn/MatMul_1"} <= set(record.kept_float)
    # and onnxruntime, fusing what the quantiser wrote, computes one product in integers and the softmax in float
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "as_run.onnx")
    ort.InferenceSession(str(dst), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "as_run.onnx")).graph.node]
    assert sum(op in int8.INTEGER_OPS + ("MatMulIntegerToFloat",) for op in ops) == 1, ops
    assert "Softmax" in ops and "QLinearSoftmax" not in ops, ops


def test_calibration_pictures_are_read_a_range_at_a_time(tmp_path):
    from PIL import Image

    (tmp_path / "images").mkdir()
    for i in range(5):
        Image.fromarray(np.full((8, 10, 3), 40 * i, np.uint8)).save(tmp_path / "images" / f"{i:02d}.png")
    files = picture_files(str(tmp_path), 4)
    assert [f.name for f in files] == ["00.png", "01.png", "02.png", "03.png"]
    pictures = int8.Pictures(files, lambda picture: {"images": picture})
    assert len(pictures) == 4
    pictures.set_range(2, 3)  # what onnxruntime's calibrator does with CalibStridedMinMax
    first = pictures.get_next()
    assert first["images"].shape == (8, 10, 3) and first["images"][0, 0, 0] == 80
    assert pictures.get_next() is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no pictures"):
        picture_files(str(tmp_path / "empty"), 4)


@pytest.mark.parametrize("overrides, says", [
    (["export.int8=half"], "choose dynamic or static"),
    (["export.int8=dynamic", "export.fp16=true"], "one precision"),
    (["export.int8=static"], "needs export.calibration"),
    (["export.int8=static", "export.calibration=x", "export.calibration_method=kl"], "minmax, entropy or percentile"),
])
def test_int8_settings_are_checked_up_front(overrides, says):
    from d2export.config import ConfigError, load

    with pytest.raises(ConfigError, match=says):
        load("textdet_tiny", overrides + ["export.output_dir=/nonexistent"])


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    """The trained micro spotter exported with export.int8=dynamic."""

    out = tmp_path_factory.mktemp("int8_dynamic")
    manifest = export("textdet_micro", out, "export.int8=dynamic", "export.lint=false")
    return manifest, out / manifest.model_file


def test_dynamic_int8_quantises_the_matmuls_keeps_the_decoders_float_and_verifies(dynamic):
    import onnx

    from d2export.cpu import cpu_features
    from d2export.families import get

    manifest, path = dynamic
    assert manifest.precision == "int8" and manifest.verification["passed"] is True  # float32 first
    v = manifest.verification["int8"]
    assert v["passed"] is True and v["top_k_agreement"] >= v["min_top_k_agreement"]
    q = v["quantization"]
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert q["mode"] == "dynamic" and q["quantized"] > 20 and ops & set(int8.INTEGER_OPS)
    kept = q["kept_float"]
    assert any("sampling_offsets" in n for n in kept) and any("ctrl_point_coord" in n for n in kept)
    assert any("/encoder/" in n for n in kept) and any("/enc_output/" in n for n in kept)
    assert all(any(f"/{scope}" in n for n in kept) for scope in TEXT_BRANCH)
    assert all(int8.in_scope(n, get("testr").int8_float_scopes) for n in kept)
    # and nothing in those modules computes in int8: not the classifier's call on the last layer (text_class_1), not
    # attention's output projection, a Gemm the quantiser turns into a MatMul of another name
    integer = [n.name for n in onnx.load(str(path)).graph.node if n.op_type in int8.INTEGER_OPS]
    assert integer and not [n for n in integer if int8.in_scope(n, get("testr").int8_float_scopes)]
    assert q["reduce_range"] is int8.reduce_range_for(cpu_features())[0]
    assert v["tolerances"]["ids"] == {"atol": 0.0, "rtol": 0.0}


def test_the_predictor_serves_the_int8_graph(dynamic):
    from PIL import Image

    from d2export.datasets import generate
    from d2export.runtime.predictor import Predictor

    _, path = dynamic
    folder = generate("text", path.parent / "pictures", count=1, seed=7, size=(320, 320), workers=1)
    picture = np.asarray(Image.open(next((folder / "images").iterdir())).convert("RGB"))
    predictor = Predictor(path)
    assert predictor.manifest.precision == "int8" and predictor.predict(picture).instances


def test_static_int8_calibrates_on_pictures_and_verifies(text_pictures, tmp_path):
    """The encoder kept float (calibrated, it moved the two-stage proposals' scores by 0.23 and a confident word was
    swapped: refused)."""

    manifest = export("textdet_micro", tmp_path, "export.int8=static", f"export.calibration={text_pictures}",
                      "export.calibration_count=16", "verify.batch=false", "export.lint=false")
    v = manifest.verification["int8"]
    assert manifest.precision == "int8" and v["passed"] is True
    assert manifest.runtime == v["runtime"] == "onnxruntime" and v["providers"] == ["CPUExecutionProvider"]
    q = v["quantization"]
    assert q["mode"] == "static" and q["calibration"] == {"pictures": 16, "method": "minmax"}
    assert q["op_types"] == ["MatMul", "Gemm"] and q["quantized"] > 20
    assert any("/encoder/" in n for n in q["kept_float"]) and any("/decoder/" in n for n in q["kept_float"])


def test_static_int8_of_the_fused_graph_is_calibrated_through_the_fused_operator_and_verifies(text_pictures,
                                                                                              tmp_path):
    """The fused sampler (the fastest float graph) quantised statically: onnxruntime's calibrator runs the graph with
    d2export's operator registered; the operator stays one float node among the int8 MatMuls, and onnxruntime's
    calibrators open their sessions as before once it is done."""
    import onnx
    from onnxruntime.quantization.calibrate import CalibraterBase

    from d2export.kernels.custom_ops import FUSED_MSDA_ID

    own = CalibraterBase.__dict__["create_inference_session"]
    manifest = export("textdet_micro", tmp_path, "export.int8=static", "export.sampler=fused",
                      f"export.calibration={text_pictures}", "export.calibration_count=8", "verify.batch=false",
                      "export.lint=false")
    v = manifest.verification["int8"]
    assert manifest.precision == "int8" and v["passed"] is True and manifest.custom_ops == [FUSED_MSDA_ID]
    nodes = onnx.load(str(tmp_path / manifest.model_file)).graph.node
    fused = [n for n in nodes if n.domain == "d2export"]
    assert fused and {n.op_type for n in fused} == {"MultiScaleDeformableAttention"}
    assert v["quantization"]["quantized"] > 20 and any(n.op_type == "QuantizeLinear" for n in nodes)
    assert CalibraterBase.__dict__["create_inference_session"] is own  # onnxruntime's own again


def test_a_wrong_int8_graph_is_refused_and_nothing_is_written(text_pictures, tmp_path, monkeypatch):
    """The spotter's convolutions and encoder quantised statically too (what text spotters keep float): proposals
    move and a confident word lands elsewhere. Refused; nothing written."""
    from d2export.verification.comparison import VerificationError
    from d2export.families import get

    monkeypatch.setattr(get("testr"), "int8_static_ops", ("Conv", "MatMul", "Gemm"))
    monkeypatch.setattr(get("testr"), "int8_float_scopes",
                        tuple(s for s in get("testr").int8_float_scopes if s not in ENCODER_AND_PROPOSALS))
    with pytest.raises(VerificationError, match="the int8 graph disagrees with eager PyTorch"):
        export("textdet_micro", tmp_path, "export.int8=static", f"export.calibration={text_pictures}",
               "export.calibration_count=8", "verify.batch=false", "verify.pin_selections=false", "export.lint=false")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))


def test_a_reader_whose_text_branch_is_quantised_is_refused(tmp_path, monkeypatch):
    """A fixture that reads: with its text branch in dynamic int8 a confident character's probability moved 0.08-0.14
    (ids equal; the weights of 10,000 pictures). Refused; nothing written."""
    from d2export.verification.comparison import VerificationError
    from d2export.families import get

    monkeypatch.setattr(get("testr"), "int8_float_scopes",
                        tuple(s for s in get("testr").int8_float_scopes if s not in TEXT_BRANCH))
    with pytest.raises(VerificationError, match="char_scores"):
        export("textdet_micro", tmp_path, "export.int8=dynamic", "verify.pin_selections=false", "export.lint=false")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))


def test_the_fused_graph_is_optimised_with_its_operator_so_convolutions_fold_their_batch_norm(tmp_path):
    """Before quantising, onnxruntime's basic optimisations run with d2export's operator registered: a Conv's
    BatchNormalization is folded into it (else no quantised Conv can fuse with its quantize/dequantize pair: every
    convolution of the fused R-50 graph stayed float, its int8 weights dequantised at each run), and the fused node
    is kept as it is."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from d2export.kernels.custom_ops import FUSED_MSDA_ID, fused_msda_model, graph_ops

    msda = onnx.load_from_string(fused_msda_model())
    rng = np.random.default_rng(5)
    init = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n) for n, s in
            [("w", (4, 3, 3, 3)), ("scale", (4,)), ("bias", (4,)), ("mean", (4,))]]
    init.append(numpy_helper.from_array(np.abs(rng.normal(size=4)).astype(np.float32) + 0.5, "var"))
    conv = [helper.make_node("Conv", ["x", "w"], ["c"], name="/backbone/conv1/Conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"], name="/backbone/bn")]
    graph = helper.make_graph(conv + list(msda.graph.node), "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
                              + list(msda.graph.input),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)] + list(msda.graph.output),
                              init)
    src = tmp_path / "src.onnx"
    onnx.save(helper.make_model(graph, opset_imports=msda.opset_import), str(src))
    int8.basic_optimised(src, tmp_path / "optimised.onnx", graph_ops(onnx.load(str(src))))
    optimised = onnx.load(str(tmp_path / "optimised.onnx"))
    ops = [n.op_type for n in optimised.graph.node]
    assert "BatchNormalization" not in ops and ops.count("Conv") == 1
    assert graph_ops(optimised) == [FUSED_MSDA_ID]
    assert [n.name for n in optimised.graph.node if n.op_type == "Conv"] == ["/backbone/conv1/Conv"]  # scopes hold


def test_modules_named_by_the_user_stay_float_and_a_misspelt_one_is_refused(tmp_path):
    """export.int8_keep_float adds modules to what the recipe keeps float: the decoder's linear2 named, its MatMuls
    keep float weights while linear1 beside it is quantised; a name matching no node is refused before anything
    is written, not quietly kept as nothing."""
    import onnx

    from d2export.config import ConfigError

    with pytest.raises(ConfigError, match=r"export.int8_keep_float: linear_2 names no convolution or MatMul"):
        export("textdet_micro", tmp_path / "misspelt", "export.int8=dynamic", "export.int8_keep_float=[linear_2]",
               "verify.enabled=false", "export.lint=false")
    assert not list((tmp_path / "misspelt").glob("*.onnx"))

    manifest = export("textdet_micro", tmp_path, "export.int8=dynamic", "export.int8_keep_float=[linear2]",
                      "verify.enabled=false", "export.lint=false")
    nodes = onnx.load(str(tmp_path / manifest.model_file)).graph.node
    integer = [n.name for n in nodes if n.op_type in int8.INTEGER_OPS]
    assert [n for n in integer if "/decoder/" in n and int8.in_scope(n, ("linear1",))]
    assert not [n for n in integer if int8.in_scope(n, ("linear2",))]
    kept = manifest.verification["int8"]["quantization"]["kept_float"]
    assert [n for n in kept if "/decoder/" in n and int8.in_scope(n, ("linear2",))]
    assert manifest.verification["int8"]["keep_float"] == ["linear2"]
