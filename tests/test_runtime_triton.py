"""The Triton model repository: config.pbtxt parsed back and checked against the ONNX graph itself; the picture
ensemble's configs parsed by Triton's own protobuf and its Python stages run in-process against the predictor."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from d2export.cli import main
from d2export.manifest import Manifest, TensorSpec, manifest_path, sha256_file
from d2export.runtime.triton import config_text, parse_pbtxt, write_repository

# ONNX element types → Triton data types, written out here independently of the writer's table
ONNX_TO_TRITON = {onnx.TensorProto.UINT8: "TYPE_UINT8", onnx.TensorProto.INT64: "TYPE_INT64",
                  onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT32: "TYPE_INT32",
                  onnx.TensorProto.FLOAT16: "TYPE_FP16", onnx.TensorProto.BOOL: "TYPE_BOOL"}


def graph_dims(value) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]


def test_repository_matches_the_onnx_graph(tiny_export, tmp_path):
    _, manifest, model_path = tiny_export
    folder = write_repository(model_path, tmp_path / "repo", "text_spotter", max_batch_size=4, queue_delay_us=500)
    assert folder == tmp_path / "repo" / "text_spotter"
    model_file = folder / "1" / "model.onnx"
    assert sha256_file(model_file) == manifest.sha256
    assert Manifest.read(manifest_path(model_file)) == manifest  # clients read pre/post-processing from it
    cfg = parse_pbtxt((folder / "config.pbtxt").read_text())
    assert cfg["name"] == folder.name and cfg["backend"] == "onnxruntime"
    assert cfg["default_model_filename"] == model_file.name
    assert cfg["max_batch_size"] == 4 and cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert cfg["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]

    graph = onnx.load(str(model_file), load_external_data=False).graph
    for section, values in (("input", graph.input), ("output", graph.output)):
        declared = cfg[section]
        assert [t["name"] for t in declared] == [v.name for v in values]
        for t, v in zip(declared, values):
            dims = graph_dims(v)
            assert dims[0] == -1, f"{v.name}: the graph's batch axis must be dynamic"
            assert t["dims"] == dims[1:], v.name  # Triton leaves the batch axis out when max_batch_size > 0
            assert t["data_type"] == ONNX_TO_TRITON[v.type.tensor_type.elem_type], v.name
    assert cfg["input"][0]["dims"] == [3, -1, -1] and cfg["output"][2]["dims"][-1] == 2


def test_fixed_batch_models_do_not_batch():
    m = Manifest(model_file="m.onnx", family="text_spotter", opset=17, exporter="torchscript",
                 inputs=[TensorSpec("images", "uint8", [1, 3, 320, "width"])],
                 outputs=[TensorSpec("scores", "float32", [1, 100])])
    cfg = parse_pbtxt(config_text(m, "fixed", kind="KIND_GPU", tensorrt=True))
    assert cfg["max_batch_size"] == 0 and "dynamic_batching" not in cfg
    assert cfg["input"][0]["dims"] == [1, 3, 320, -1] and cfg["output"][0]["dims"] == [1, 100]
    assert cfg["instance_group"][0]["kind"] == "KIND_GPU"
    assert cfg["optimization"]["execution_accelerators"]["gpu_execution_accelerator"] == [{"name": "tensorrt"}]


def test_pbtxt_parser_reads_the_text_format():
    text = '''
    # a comment line
    name: "a \\"quoted\\" name"   # trailing comment
    max_batch_size: 8
    input { name: "x" dims: [ 3, -1 ] }
    input { name: "y" dims: [ 2 ] }
    output [ { name: "z", data_type: TYPE_FP32 } ]
    parameters { key: "k" value: { string_value: "v" } }
    ratio: 0.5
    flag: true
    '''
    cfg = parse_pbtxt(text)
    assert cfg["name"] == 'a "quoted" name' and cfg["max_batch_size"] == 8
    assert cfg["input"] == [{"name": "x", "dims": [3, -1]}, {"name": "y", "dims": [2]}]
    assert cfg["output"] == [{"name": "z", "data_type": "TYPE_FP32"}]
    assert cfg["parameters"] == {"key": "k", "value": {"string_value": "v"}}
    assert cfg["ratio"] == 0.5 and cfg["flag"] is True
    for broken in ("input { name: \"x\"", "a: 1 }", "a: \"unterminated"):
        with pytest.raises(ValueError):
            parse_pbtxt(broken)


def test_model_names_are_checked(tiny_export, tmp_path):
    with pytest.raises(ValueError, match="model name"):
        write_repository(tiny_export[2], tmp_path, "bad/name")


# the picture ensemble: Triton's own config protobuf, and the Python stages run in-process --------------------------
NUMPY_OF = {"TYPE_UINT8": np.uint8, "TYPE_INT64": np.int64, "TYPE_FP32": np.float32, "TYPE_INT32": np.int32,
            "TYPE_FP16": np.float16, "TYPE_BOOL": np.bool_, "TYPE_STRING": np.object_}


def model_config_pb2():
    """Triton's ModelConfig protobuf as tritonclient ships it. Loaded by file: `tritonclient.grpc`'s package
    import wants grpcio, which only the network client needs."""
    import importlib.util

    import tritonclient

    spec = importlib.util.spec_from_file_location(
        "triton_model_config_pb2", Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def picture_repo(tiny_export, tmp_path_factory):
    """The repository with the picture ensemble, every config.pbtxt parsed by Triton's protobuf (strictly: an
    unknown field or a wrong type fails)."""
    from google.protobuf import text_format

    repo = tmp_path_factory.mktemp("triton_pictures")
    assert main(["triton-repo", str(tiny_export[2]), str(repo), "--name", "spotter", "--pictures",
                 "--max-batch-size", "4"]) == 0
    pb2 = model_config_pb2()
    configs = {f.parent.name: text_format.Parse(f.read_text(), pb2.ModelConfig())
               for f in repo.glob("*/config.pbtxt")}
    return repo, configs, pb2


def test_picture_ensemble_configs_are_valid_triton_configs(picture_repo, tiny_export):
    repo, configs, pb2 = picture_repo
    assert set(configs) == {"spotter", "spotter_pre", "spotter_post", "spotter_pictures"}
    ensemble = configs["spotter_pictures"]
    assert ensemble.platform == "ensemble" and (repo / "spotter_pictures" / "1").is_dir()
    assert [(t.name, pb2.DataType.Name(t.data_type), list(t.dims)) for t in ensemble.input] == [
        ("IMAGE", "TYPE_STRING", [1])]
    assert [(t.name, pb2.DataType.Name(t.data_type), list(t.dims)) for t in ensemble.output] == [
        ("INSTANCES", "TYPE_STRING", [1])]
    for name in ("spotter_pre", "spotter_post"):
        assert configs[name].backend == "python"
        assert configs[name].parameters["d2export_stage"].string_value == name.rsplit("_", 1)[1]
        assert "import TritonPythonModel" in (repo / name / "1" / "model.py").read_text()
        manifest = repo / name / "1" / "model.manifest.json"
        assert manifest.read_bytes() == (repo / "spotter" / "1" / "model.manifest.json").read_bytes()
    for cfg in configs.values():
        assert cfg.max_batch_size == 4  # an ensemble batches no more than its steps

    # the chain Triton checks when it loads an ensemble: every step's inputs are the ensemble's input or an earlier
    # step's outputs, of the same type and shape, each model's inputs all fed, the ensemble's output produced
    graph = onnx.load(str(repo / "spotter" / "1" / "model.onnx"), load_external_data=False).graph
    produced = {t.name: (t.data_type, list(t.dims)) for t in ensemble.input}
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["spotter_pre", "spotter", "spotter_post"]
    for s in steps:
        model = configs[s.model_name]
        inputs = {t.name: (t.data_type, list(t.dims)) for t in model.input}
        assert set(s.input_map) == set(inputs), s.model_name
        for key, tensor in s.input_map.items():
            assert produced[tensor] == inputs[key], (s.model_name, key)
        outputs = {t.name: (t.data_type, list(t.dims)) for t in model.output}
        assert set(s.output_map) <= set(outputs)
        produced.update({tensor: outputs[key] for key, tensor in s.output_map.items()})
    assert produced[ensemble.output[0].name] == (ensemble.output[0].data_type, list(ensemble.output[0].dims))
    # and the graph step's tensors are the ONNX graph's own
    assert [t.name for t in configs["spotter"].input] == [v.name for v in graph.input]
    assert [t.name for t in configs["spotter"].output] == [v.name for v in graph.output]


class StandIn:
    """A minimal triton_python_backend_utils: tensors, requests, responses, errors."""

    class Tensor:
        def __init__(self, name: str, array):
            self._name, self._array = name, np.asarray(array)

        def name(self) -> str:
            return self._name

        def as_numpy(self):
            return self._array

    class InferenceRequest:
        def __init__(self, inputs):
            self.inputs = {t.name(): t for t in inputs}

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.outputs, self.error = {t.name(): t.as_numpy() for t in output_tensors}, error

    class TritonError:
        def __init__(self, message: str):
            self.message = message

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)


def load_stage(repo: Path, name: str, config):
    """The stage's own model.py, initialised as Triton's Python backend does (the config as JSON)."""
    import importlib.util
    import json

    from google.protobuf import json_format

    spec = importlib.util.spec_from_file_location(f"stage_{name}", repo / name / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
                      "model_repository": str(repo / name), "model_version": "1", "model_name": name,
                      "model_instance_kind": "CPU", "model_instance_device_id": "0"})
    return model


def test_python_stages_answer_as_the_predictor(picture_repo, tiny_export, monkeypatch):
    import io
    import json

    import onnxruntime as ort
    from PIL import Image

    from d2export.resizing import synthetic_image
    from d2export.runtime.image_decoding import decode_image
    from d2export.runtime.predictor import Predictor

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", StandIn)
    repo, configs, pb2 = picture_repo
    pre, post = (load_stage(repo, f"spotter_{s}", configs[f"spotter_{s}"]) for s in ("pre", "post"))

    def encoded(h, w, seed, fmt="JPEG"):
        buf = io.BytesIO()
        Image.fromarray(synthetic_image(h, w, seed).transpose(1, 2, 0)).save(buf, fmt)
        return buf.getvalue()

    # a request of one non-square picture, one of two pictures of different sizes, one of a corrupt picture
    pictures = [[encoded(97, 211, 1)], [encoded(180, 120, 2, "PNG"), encoded(64, 300, 3)], [encoded(50, 50, 4)[:60]]]
    requests = [StandIn.InferenceRequest([StandIn.Tensor("IMAGE", np.array(p, dtype=object).reshape(-1, 1))])
                for p in pictures]
    prepared = pre.execute(requests)
    assert len(prepared) == 3 and prepared[2].error is not None and "truncated" in prepared[2].error.message
    session = ort.InferenceSession(str(repo / "spotter" / "1" / "model.onnx"))  # the ONNX step, as Triton runs it
    predictor = Predictor(tiny_export[2], threads=1)
    for request_pictures, response in zip(pictures, prepared[:2]):
        assert response.error is None
        for t in configs["spotter_pre"].output:  # what the config promises: types and per-picture shapes
            out = response.outputs[t.name]
            assert out.dtype == NUMPY_OF[pb2.DataType.Name(t.data_type)] and out.shape[0] == len(request_pictures)
            assert all(d == -1 or d == s for d, s in zip(t.dims, out.shape[1:])) and len(t.dims) == out.ndim - 1
        feeds = {v.name: response.outputs[v.name] for v in session.get_inputs()}
        graph = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        carried = [StandIn.Tensor(k, v) for k, v in graph.items()]
        carried += [StandIn.Tensor(k, response.outputs[k]) for k in ("input_sizes", "original_sizes")]
        (answer,) = post.execute([StandIn.InferenceRequest(carried)])
        found = answer.outputs["INSTANCES"]
        assert found.shape == (len(request_pictures), 1) and found.dtype == object
        expected = predictor.predict_batch([decode_image(p) for p in request_pictures])
        assert [json.loads(f) for f in found[:, 0]] == [json.loads(json.dumps(e.to_dict())) for e in expected]
        assert all(len(json.loads(f)["instances"]) > 0 for f in found[:, 0])


def test_post_stage_answers_segmentation_maps_as_base64_png(picture_repo, monkeypatch):
    import json

    from test_runtime_maps import decoded, segmentation_prediction

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", StandIn)
    repo, configs, _ = picture_repo
    post = load_stage(repo, "spotter_post", configs["spotter_post"])
    # the stage's family post-processing answered as a segmentation model's
    post.processing.prediction = lambda outputs, index, input_hw, original_hw, *a, **k: segmentation_prediction(
        *map(int, original_hw))
    sizes = np.array([[64, 96], [80, 40]], np.int64)
    carried = [StandIn.Tensor(name, np.zeros((2, 1), np.float32)) for name in post.processing.output_names]
    carried += [StandIn.Tensor("input_sizes", sizes), StandIn.Tensor("original_sizes", sizes)]
    (answer,) = post.execute([StandIn.InferenceRequest(carried)])
    for found, (h, w) in zip(answer.outputs["INSTANCES"][:, 0], sizes.tolist()):
        body, want = json.loads(found), segmentation_prediction(h, w)
        for key in ("semantic", "panoptic"):
            assert body[key]["shape"] == [h, w]
            np.testing.assert_array_equal(decoded(body[key]), getattr(want, key))
        assert [s["id"] for s in body["segments"]] == [1, 2, 3, 700]
