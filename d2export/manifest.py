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
    # a session must register them (d2export.runtime.custom_ops)
    custom_ops: list[str] = field(default_factory=list)
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
        d = dict(d)
        version = d.get("schema_version", SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise ValueError(f"manifest schema {version} is newer than this d2export understands ({SCHEMA_VERSION})")
        d["inputs"] = [TensorSpec(**t) for t in d["inputs"]]
        d["outputs"] = [TensorSpec(**t) for t in d["outputs"]]
        return cls(**d)

    def write(self, path: str | os.PathLike) -> None:
        write_atomic(Path(path), (json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n").encode())

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Manifest":
        return cls.from_dict(json.loads(Path(path).read_text()))


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
