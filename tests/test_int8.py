"""export.int8: onnxruntime's quantization on the verified float32 graph, with what int8 breaks kept float."""
import numpy as np
import pytest

from d2export.exporting import int8
from d2export.verification.pictures import picture_files
from exports import Feeds, export

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


def _projection(tmp_path, bits: int):
    """A float32 MatMul [1, 4, 64] x [64, 8] quantised statically with `bits`-bit weights; its first column is
    all 1.0, so per-channel weights reach 127 there and activations at the top of their range make pairs of
    u8 x s8 products past int16."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(5)
    w = g.uniform(-1, 1, (64, 8)).astype(np.float32)
    w[:, 0] = 1.0
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="/proj/MatMul")], "projection",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
                              [numpy_helper.from_array(w, "w")])
    src, dst = tmp_path / "float.onnx", tmp_path / f"int{bits}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    feeds = Feeds([{"x": g.uniform(0, 1, (1, 4, 64)).astype(np.float32)} for _ in range(4)])
    record = int8.quantize(src, dst, "static", (), ["avx2"], feeds, static_ops=("MatMul",), weight_bits=bits)
    return dst, record


def _integer_product(path, x: np.ndarray) -> tuple[np.ndarray, int]:
    """ONNX's QuantizeLinear / DequantizeLinear rules on the graph's own scales, zero points and int8 weights, in
    exact integers: y[n] = sx * sw[n] * sum_k (xq[k] - zx) * wq[k, n]; and the largest pair of u8 x s8 products
    (k, k+1) a 16-bit pairwise kernel would sum."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    stored, nodes = {t.name: numpy_helper.to_array(t) for t in graph.initializer}, graph.node
    (qx,) = [n for n in nodes if n.op_type == "QuantizeLinear" and n.input[0] == "x"]
    (dw,) = [n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in stored]
    sx, zx = float(stored[qx.input[1]]), int(stored[qx.input[2]])
    wq, sw = stored[dw.input[0]].astype(np.int64), stored[dw.input[1]].astype(np.float64)
    xq = np.clip(np.rint(x.astype(np.float64) / sx) + zx, 0, 255).astype(np.int64)
    y = sx * sw * ((xq - zx) @ wq)
    pairs = xq[..., 0::2, None] * wq[0::2] + xq[..., 1::2, None] * wq[1::2]
    return y, int(np.abs(pairs).max())


def test_8bit_weights_are_served_exactly_on_any_cpu(tmp_path, monkeypatch):
    """An int8 graph quantised with 8-bit weights (for a CPU with VNNI) and served where u8 x s8 products are
    summed in pairs into 16 bits (x86 without VNNI) would saturate: onnxruntime sessions of int8 graphs there ask for
    exact products, and the served values are the integer rule's. 7-bit weights cannot saturate and keep their
    kernels."""
    import platform

    import onnxruntime as ort

    from d2export import cpu
    from d2export.runtime.providers import EXACT_INT8_KEY, exact_int8, serving_settings

    path, record = _projection(tmp_path, 8)
    assert not record.reduce_range and "export.int8_weight_bits=8" in record.why_reduce_range
    x = np.ones((1, 4, 64), np.float32)  # every activation at the top of its calibrated range
    expected, widest_pair = _integer_product(path, x)
    assert widest_pair > 2**15 - 1  # a pairwise 16-bit kernel would saturate on this input
    options = ort.SessionOptions()
    serving_settings(options, ["CPUExecutionProvider"], "int8")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-5)
    assert exact_int8(session) == cpu.int8_pairs_saturate()  # recorded as what a server must ask for

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for features, exact in ((["avx2", "avx512f"], True), (["avx2", "avx_vnni"], False), (["amx_int8"], False)):
        monkeypatch.setattr(cpu, "cpu_features", lambda: features)
        for precision in ("int8", "float32"):
            options = ort.SessionOptions()
            serving_settings(options, ["CPUExecutionProvider"], precision)
            try:
                value = options.get_session_config_entry(EXACT_INT8_KEY)
            except RuntimeError:
                value = None
            assert (value == "1") == (exact and precision == "int8"), (features, precision, value)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # no pairwise 16-bit kernels there
    assert not cpu.int8_pairs_saturate(["avx2"])

    path7, record7 = _projection(tmp_path, 7)
    assert record7.reduce_range and _integer_product(path7, x)[1] <= 2**15 - 1


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_a_weight_two_nodes_read_is_given_to_each_so_exact_products_load(tmp_path, mode):
    """A module called twice (the character head on two decoder layers) has one weight read by two MatMuls.
    onnxruntime's exact products convert int8 weights to uint8 per reading node and refused such a session
    ("Attempt to replace the existing tensor"): each reader gets its own copy, and the session loads and computes
    both products alike."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    g = np.random.default_rng(9)
    w = g.uniform(-1, 1, (16, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="/head/MatMul"),
             helper.make_node("Relu", ["x"], ["x1"], name="/later/Relu"),
             helper.make_node("MatMul", ["x1", "w"], ["b"], name="/head_1/MatMul")]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in "ab"],
                              [numpy_helper.from_array(w, "w")])
    src, dst = tmp_path / "float.onnx", tmp_path / "int8.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    feeds = Feeds([{"x": g.uniform(0, 1, (2, 16)).astype(np.float32)} for _ in range(4)])
    int8.quantize(src, dst, mode, (), ["avx2"], feeds if mode == "static" else None, static_ops=("MatMul",),
                  weight_bits=8)
    model = onnx.load(str(dst))
    int8_weights = {t.name for t in model.graph.initializer if t.data_type == TensorProto.INT8}
    reads = [i for n in model.graph.node for i in n.input]
    dequantized = [n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"
                   and n.input[0] in int8_weights]
    assert int8_weights and all(reads.count(name) == 1 for name in int8_weights | set(dequantized))

    options = ort.SessionOptions()
    options.add_session_config_entry("session.x64quantprecision", "1")
    x = g.uniform(0, 1, (2, 16)).astype(np.float32)
    a, b = ort.InferenceSession(str(dst), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, x @ w, atol=0.05 * np.abs(x @ w).max())


def test_openvino_refuses_8bit_weights_where_they_would_saturate(tmp_path, monkeypatch):
    """OpenVINO has no exact mode for them: on an x86 CPU without VNNI an int8 graph with 8-bit weights is refused in
    one line; 7-bit weights, or a CPU with VNNI or AMX, are served."""
    import platform

    from d2export.runtime.openvino_session import require_exact_int8
    from d2export.runtime.providers import ProviderUnavailable

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    (tmp_path / "8").mkdir()
    (tmp_path / "7").mkdir()
    eight, seven = _projection(tmp_path / "8", 8)[0], _projection(tmp_path / "7", 7)[0]
    with pytest.raises(ProviderUnavailable, match=r"int8 weights use 8 bits.*it has avx2\): serve it through "
                                                  r"onnxruntime.*export.int8_weight_bits=7"):
        require_exact_int8(eight, ["avx2"])
    require_exact_int8(seven, ["avx2"])
    require_exact_int8(eight, ["avx2", "avx512_vnni"])
    require_exact_int8(eight, ["amx_int8"])


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

    feeds = Feeds([{"x": rng.standard_normal((1, 6, 8)).astype(np.float32)} for _ in range(4)])
    record = int8.quantize(src, dst, "static", (), ["avx512_vnni"], feeds, static_ops=("MatMul",))
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
    (["export.int8=static", "export.calibration=x", "export.int8_weight_bits=4"], "choose 7, 8 or 0"),
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
