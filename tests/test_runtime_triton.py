"""The Triton model repository: config.pbtxt parsed back and checked against the ONNX graph itself."""
from __future__ import annotations

import onnx
import pytest

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
