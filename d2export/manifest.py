"""The manifest written beside every exported model: everything the runtime needs to know, and how it was made.

Torch-free on purpose: the serving runtime reads it without torch or detectron2.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 1


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "uint8", "float32", "int64", …
    shape: list  # ints for fixed dims, strings for dynamic axes ("batch", "height", "width")
    doc: str = ""


@dataclass
class Manifest:
    model_file: str
    family: str  # the model family (d2export/families) that reads the outputs: "testr", "rcnn", …
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    opset: int
    exporter: str
    sampler: str = ""
    # d2export custom operators the graph holds ("d2export.MultiScaleDeformableAttention" for export.sampler=fused):
    # a session must register them (d2export.kernels.custom_ops)
    custom_ops: list[str] = field(default_factory=list)
    precision: str = "float32"  # "float16" with export.fp16 (MSDA sampling, Softmax, … float32 inside)
    # what serves the graph: onnxruntime, or "openvino" for precision "bfloat16" (export.bf16: the graph is float32,
    # OpenVINO computes it in bfloat16 where the CPU has it) and for "int8" with export.runtime=openvino (the QDQ
    # graph's quantised products in int8, the rest in float32); runtime/openvino_session.py
    runtime: str = "onnxruntime"
    # what the runtime needs for pre- and post-processing
    preprocess: dict[str, Any] = field(default_factory=dict)  # input_format, min_size_test, max_size_test, size_divisibility
    postprocess: dict[str, Any] = field(default_factory=dict)  # score_threshold, voc, use_polygon, …
    versions: dict[str, str] = field(default_factory=dict)
    patches: list[dict[str, Any]] = field(default_factory=list)
    verification: dict[str, Any] = field(default_factory=dict)
    export_seconds: float = 0.0
    sha256: str = ""
    weights: dict[str, Any] = field(default_factory=dict)  # path, sha256, strict, missing/unexpected/mismatched
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        """Validated against the schema (the dataclasses above, checked by pydantic): a wrong type or a missing field
        is one line naming it."""
        import pydantic

        version = d.get("schema_version", SCHEMA_VERSION) if isinstance(d, dict) else SCHEMA_VERSION
        if isinstance(version, int) and version > SCHEMA_VERSION:
            raise ValueError(f"manifest schema {version} is newer than this d2export understands ({SCHEMA_VERSION})")
        try:
            return pydantic.TypeAdapter(cls).validate_python(d)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "(top level)"
            raise ValueError(f"manifest does not match its schema: {where}: {first['msg']}"
                             + (f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else "")) from None

    @classmethod
    def from_model(cls, model_path: str | os.PathLike) -> "Manifest":
        """The essentials a model carries in its metadata_props (`embed_manifest`), with the input/output schema read
        from the graph: a lone .onnx can be served."""
        import onnx

        model = onnx.load(str(model_path), load_external_data=False)
        metadata = {p.key: p.value for p in model.metadata_props}
        if METADATA_KEY not in metadata:
            raise ValueError(f"{Path(model_path).name}: no manifest beside it ({manifest_path(model_path).name}) and "
                             f"none inside it (metadata_props {METADATA_KEY!r})")
        return cls.from_dict(json.loads(metadata[METADATA_KEY]) | {
            "model_file": Path(model_path).name, "inputs": graph_specs(model.graph.input),
            "outputs": graph_specs(model.graph.output)})

    def write(self, path: str | os.PathLike) -> None:
        write_atomic(Path(path), (json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n").encode())

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Manifest":
        return cls.from_dict(json.loads(Path(path).read_text()))


METADATA_KEY = "d2export.manifest"


def graph_specs(values) -> list[TensorSpec]:
    """Names, dtypes and shapes of graph inputs or outputs as the graph declares them (dynamic axes by name)."""
    from onnx import helper

    specs = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in t.shape.dim]
        specs.append(TensorSpec(v.name, str(helper.tensor_dtype_to_np_dtype(t.elem_type)), shape, v.doc_string))
    return specs


def embed_manifest(model_path: str | os.PathLike, manifest: Manifest) -> None:
    """Write the manifest's essentials (family, pre/post-processing with the charset, precision, schema and export
    versions) into the ONNX file's metadata_props, plus a few keys readable at a glance (Netron, onnx.load), and
    what each input and output holds as its doc_string."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    docs = {t.name: t.doc for t in manifest.inputs + manifest.outputs if t.doc}
    for value in list(model.graph.input) + list(model.graph.output):
        value.doc_string = docs.get(value.name, value.doc_string)
    essentials = {k: v for k, v in manifest.to_dict().items()
                  if k not in ("patches", "verification", "sha256", "export_seconds", "inputs", "outputs")}
    essentials["opset"] = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    entries = {METADATA_KEY: json.dumps(essentials, ensure_ascii=False), "d2export.family": manifest.family,
               "d2export.schema_version": str(manifest.schema_version), "d2export.precision": manifest.precision,
               "d2export.version": manifest.versions.get("d2export", "")}
    kept = [p for p in model.metadata_props if p.key not in entries]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in entries.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(model_path))


def manifest_path(model_path: str | os.PathLike) -> Path:
    """`model.onnx` → `model.manifest.json`, beside it."""
    p = Path(model_path)
    return p.with_name(p.stem + ".manifest.json")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def readable_by_all(path: str | os.PathLike) -> None:
    """mkstemp makes files 0600; a model is for serving (Triton may run as another user): 0644 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o644 & ~umask)


@contextlib.contextmanager
def staged(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary file beside `path` for the block to write; renamed onto `path` (readable by all) when the block
    succeeds, removed when it fails: readers never see half a file, and a failure leaves nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=suffix)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        readable_by_all(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    with staged(path) as tmp:
        tmp.write_bytes(data)
