"""A Triton Inference Server model repository for an exported model (onnxruntime backend).

    <repo>/<name>/config.pbtxt
    <repo>/<name>/1/model.onnx               (hard-linked where possible, else copied)
    <repo>/<name>/1/model.manifest.json      (for clients: pre- and post-processing stay with them)
    <repo>/<name>/libd2export_msda.so        (a fused graph only: d2export's native operator library, which the
                                              config names in model_operations for the onnxruntime backend to load)

With `--pictures`, also a model that takes encoded pictures and answers instances, as an ensemble:

    <repo>/<name>_pre/     Python backend: decode, resize, pad (d2export.runtime.triton_python)
    <repo>/<name>_post/    Python backend: the family's post-processing → JSON per picture
    <repo>/<name>_pictures/  ensemble: IMAGE (bytes) → <name>_pre → <name> → <name>_post → INSTANCES (bytes)

Names, data types and shapes come from the manifest, which records them as the graph declares them. When every input
and output has a dynamic leading axis, the model batches: `max_batch_size` > 0, dims leave the batch axis out, and
Triton's dynamic batcher may join requests (of equal shapes). Other dynamic axes are -1.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from d2export.argparsing import parser
from d2export.manifest import Manifest, TensorSpec, manifest_path

log = logging.getLogger(__name__)

TRITON_TYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32",
                "uint64": "TYPE_UINT64", "int8": "TYPE_INT8", "int16": "TYPE_INT16", "int32": "TYPE_INT32",
                "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32", "float64": "TYPE_FP64",
                "bytes": "TYPE_STRING"}


def _dynamic(d: Any) -> bool:
    return not isinstance(d, int) or d <= 0


def batchable(manifest: Manifest) -> bool:
    """Every tensor's first axis is dynamic (the graph's batch axis)."""
    return all(t.shape and _dynamic(t.shape[0]) for t in manifest.inputs + manifest.outputs)


def _tensor_block(t: TensorSpec, skip_batch: bool) -> str:
    if t.dtype not in TRITON_TYPES:
        raise ValueError(f"{t.name}: dtype {t.dtype} has no Triton type")
    dims = [-1 if _dynamic(d) else int(d) for d in (t.shape[1:] if skip_batch else t.shape)]
    return (f'  {{\n    name: "{t.name}"\n    data_type: {TRITON_TYPES[t.dtype]}\n'
            f'    dims: [ {", ".join(map(str, dims))} ]\n  }}')


def _model_config(name: str, header: list[str], batch: int, inputs: list[TensorSpec], outputs: list[TensorSpec],
                  queue_delay_us: int, instances: int, kind: str) -> list[str]:
    lines = [f'name: "{name}"', *header, f"max_batch_size: {batch}",
             "input [\n" + ",\n".join(_tensor_block(t, batch > 0) for t in inputs) + "\n]",
             "output [\n" + ",\n".join(_tensor_block(t, batch > 0) for t in outputs) + "\n]"]
    if batch > 0:
        lines.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {queue_delay_us}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]")
    return lines


def config_text(manifest: Manifest, name: str, max_batch_size: int = 8, queue_delay_us: int = 2000,
                instances: int = 1, kind: str = "KIND_CPU", tensorrt: bool = False, op_library: str = "") -> str:
    """config.pbtxt for the onnxruntime backend; `op_library`: the custom-op library's path as the server sees it."""
    batch = max_batch_size if batchable(manifest) else 0
    lines = _model_config(name, ['backend: "onnxruntime"', f'default_model_filename: "{manifest.model_file}"'],
                          batch, manifest.inputs, manifest.outputs, queue_delay_us, instances, kind)
    if op_library:  # the backend hands it to onnxruntime (RegisterCustomOpsLibrary) when it loads the model
        lines.append(f'model_operations {{\n  op_library_filename: "{op_library}"\n}}')
    if tensorrt:
        lines.append('optimization {\n  execution_accelerators {\n    gpu_execution_accelerator [\n'
                     '      { name: "tensorrt" }\n    ]\n  }\n}')
    return "\n".join(lines) + "\n"


def picture_tensors(manifest: Manifest) -> dict[str, list[TensorSpec]]:
    """The Python stages' inputs and outputs; the leading axis is the graph's (the batch, or its fixed size)."""
    from d2export.runtime import triton_python as tp

    lead = manifest.inputs[0].shape[0]
    sizes = [TensorSpec(tp.INPUT_SIZES, "int64", [lead, 2]), TensorSpec(tp.ORIGINAL_SIZES, "int64", [lead, 2])]
    return {"pre_in": [TensorSpec(tp.IMAGE, "bytes", [lead, 1], "an encoded picture (JPEG, PNG, …)")],
            "pre_out": manifest.inputs + sizes, "post_in": manifest.outputs + sizes,
            "post_out": [TensorSpec(tp.INSTANCES, "bytes", [lead, 1], "JSON: height, width, instances")]}


def picture_configs(manifest: Manifest, name: str, max_batch_size: int = 8, queue_delay_us: int = 2000,
                    instances: int = 1) -> dict[str, str]:
    """Model name → config.pbtxt for the two Python stages and the ensemble around the graph `name`."""
    from d2export.runtime import triton_python as tp

    batch = max_batch_size if batchable(manifest) else 0
    t = picture_tensors(manifest)
    configs = {}
    for stage, inputs, outputs in (("pre", t["pre_in"], t["pre_out"]), ("post", t["post_in"], t["post_out"])):
        lines = _model_config(f"{name}_{stage}", ['backend: "python"'], batch, inputs, outputs, queue_delay_us,
                              instances, "KIND_CPU")
        lines.append(f'parameters {{\n  key: "{tp.STAGE}"\n  value: {{ string_value: "{stage}" }}\n}}')
        configs[f"{name}_{stage}"] = "\n".join(lines) + "\n"

    def step(model: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> str:
        maps = [f'input_map {{ key: "{s.name}" value: "{s.name}" }}' for s in inputs]  # tensors keep their names
        maps += [f'output_map {{ key: "{s.name}" value: "{s.name}" }}' for s in outputs]
        return f'    {{\n      model_name: "{model}"\n      model_version: -1\n      ' + "\n      ".join(maps) + "\n    }"

    steps = [step(f"{name}_pre", t["pre_in"], t["pre_out"]), step(name, manifest.inputs, manifest.outputs),
             step(f"{name}_post", t["post_in"], t["post_out"])]
    lines = [f'name: "{name}_pictures"', 'platform: "ensemble"', f"max_batch_size: {batch}",
             "input [\n" + _tensor_block(t["pre_in"][0], batch > 0) + "\n]",
             "output [\n" + _tensor_block(t["post_out"][0], batch > 0) + "\n]",
             "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}"]
    configs[f"{name}_pictures"] = "\n".join(lines) + "\n"
    return configs


MODEL_PY = '''"""Written by `d2export triton-repo --pictures`: the d2export runtime's own pre- or post-processing (the stage is
this model's config parameter d2export_stage). Triton's Python needs d2export with numpy and Pillow:
`pip install --no-deps d2export && pip install numpy Pillow`."""
from d2export.runtime.triton_python import TritonPythonModel  # noqa: F401
'''


def write_picture_models(model_path: str | os.PathLike, repo: str | os.PathLike, name: str, version: int = 1,
                         **config: Any) -> list[Path]:
    """Writes the Python stages and the ensemble beside `<repo>/<name>/` (see write_repository); returns their
    folders. `config`: as picture_configs's keywords."""
    from d2export.runtime import triton_python as tp

    manifest = Manifest.read(manifest_path(model_path))
    folders = []
    for model, text in picture_configs(manifest, name, **config).items():
        folder = Path(repo) / model
        (folder / str(version)).mkdir(parents=True, exist_ok=True)
        if not model.endswith("_pictures"):  # Python stages: the shim and the manifest it reads
            (folder / str(version) / "model.py").write_text(MODEL_PY)
            shutil.copyfile(manifest_path(model_path), folder / str(version) / tp.MANIFEST)
        (folder / "config.pbtxt").write_text(text)
        folders.append(folder)
    return folders


OP_LIBRARY = "libd2export_msda.so"  # the native operator library's name in a model's folder


def operator_library(manifest: Manifest, model_path: Path) -> str | None:
    """The native custom-op library a model's graph needs in Triton (None: it needs none), or a ValueError saying
    why it cannot be had here: Triton's onnxruntime backend loads C libraries, not d2export's numba kernel."""
    from d2export.kernels import custom_ops

    if not manifest.custom_ops:
        return None
    unknown = [op for op in manifest.custom_ops if op not in custom_ops.KNOWN]
    library = custom_ops.native_library()
    if unknown or library is None:
        why = (f"this d2export does not provide {', '.join(unknown)}" if unknown else
               "d2export's native operator library is not built here (reinstall d2export where a C++ compiler "
               "exists: pip install -e .)")
        raise ValueError(f"{model_path} uses custom operator(s) {', '.join(manifest.custom_ops)}, which Triton's "
                         f"onnxruntime backend can load only as a native library, and {why}; or export with "
                         "export.sampler=gather for Triton")
    return library


def write_repository(model_path: str | os.PathLike, repo: str | os.PathLike, name: str | None = None,
                     version: int = 1, mount: str | None = None, **config: Any) -> Path:
    """Writes (or refreshes) `<repo>/<name>/`; returns that folder. A fused graph gets d2export's native operator
    library beside its config, named there by its path on the server: `<mount>/<name>/libd2export_msda.so`, where
    `mount` is where the server sees the repository (default: the repository's absolute path here). `config`: as
    config_text's keywords."""
    model_path = Path(model_path)
    manifest = Manifest.read(manifest_path(model_path))
    if manifest.runtime != "onnxruntime":  # export.bf16: Triton's onnxruntime backend would serve it in float32
        raise ValueError(f"{model_path} is a {manifest.precision} graph served by {manifest.runtime}, not Triton's "
                         "onnxruntime backend: export it in float32 or float16 for Triton")
    quantization = (manifest.verification or {}).get("int8", {}).get("quantization", {})
    if manifest.precision == "int8" and quantization.get("reduce_range") is False:
        log.warning("%s: its int8 weights use 8 bits: serve it on CPUs with VNNI or AMX. On one without, Triton's "
                    "onnxruntime backend would saturate their products: it passes no config entry that asks for exact "
                    "ones (d2export's own sessions do); export.int8_weight_bits=7 suits any CPU", model_path.name)
    library = operator_library(manifest, model_path)  # checked before anything is written
    name = name or model_path.stem
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(f"model name {name!r}: use letters, digits, '_', '-', '.'")
    if mount is not None and not mount.startswith("/"):
        raise ValueError(f"--mount {mount!r}: the repository's absolute path on the server (e.g. /models)")
    folder = Path(repo) / name
    version_dir = folder / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    target = version_dir / manifest.model_file
    target.unlink(missing_ok=True)
    try:
        os.link(model_path, target)  # the exporter replaces files by renaming, so a link never changes under us
    except OSError:
        shutil.copyfile(model_path, target)
    shutil.copyfile(manifest_path(model_path), manifest_path(target))
    if library:
        shutil.copyfile(library, folder / OP_LIBRARY)
        root = mount.rstrip("/") if mount is not None else str(Path(repo).resolve())
        config["op_library"] = f"{root}/{name}/{OP_LIBRARY}"
    (folder / "config.pbtxt").write_text(config_text(manifest, name, **config))
    return folder


# protobuf text format, enough of it to read a config.pbtxt back ------------------------------------------------------
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|#[^\n]*|[{}\[\]:,;]|[^\s{}\[\]:,;"#]+')


def parse_pbtxt(text: str) -> dict[str, Any]:
    """Protobuf text format → dict. A field given once is a value (a dict for a message), a repeated field or a
    `[…]` list is a list; numbers become int/float, enums and identifiers stay strings."""
    tokens, end = [], 0
    for m in _TOKEN.finditer(text):
        if text[end:m.start()].strip():
            raise ValueError(f"pbtxt: cannot read at offset {end}: {text[end:end + 20]!r}")
        end = m.end()
        if not m.group().startswith("#"):
            tokens.append(m.group())
    if text[end:].strip():
        raise ValueError(f"pbtxt: cannot read at offset {end}: {text[end:end + 20]!r}")
    return _message(tokens, 0, top=True)[0]


def _scalar(tok: str) -> Any:
    if tok.startswith('"'):
        return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
    for cast in (int, float):
        try:
            return cast(tok)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(tok, tok)


def _value(tokens: list[str], i: int) -> tuple[Any, int]:
    if tokens[i] == "{":
        return _message(tokens, i + 1)
    if tokens[i] == "[":
        items, i = [], i + 1
        while tokens[i] != "]":
            item, i = _value(tokens, i)
            items.append(item)
            if tokens[i] == ",":
                i += 1
        return items, i + 1
    return _scalar(tokens[i]), i + 1


def _message(tokens: list[str], i: int, top: bool = False) -> tuple[dict[str, Any], int]:
    fields: dict[str, Any] = {}
    while i < len(tokens) and tokens[i] != "}":
        key, i = tokens[i], i + 1
        if tokens[i] == ":":
            i += 1
        value, i = _value(tokens, i)
        if key in fields:  # a repeated field written out once per element
            prior = fields[key]
            fields[key] = (prior if isinstance(prior, list) else [prior]) + (value if isinstance(value, list)
                                                                              else [value])
        else:
            fields[key] = value
        if i < len(tokens) and tokens[i] in (",", ";"):
            i += 1
    if top and i < len(tokens):
        raise ValueError("pbtxt: unbalanced '}'")
    if not top and i >= len(tokens):
        raise ValueError("pbtxt: missing '}'")
    return fields, i + (0 if top else 1)


def main(argv: list[str] | None = None) -> int:
    ap = parser("d2export triton-repo", "Write a Triton Inference Server model repository for an exported model.")
    ap.add_argument("model", help="the exported .onnx (its manifest lies beside it)")
    ap.add_argument("repo", help="the model repository folder (created if missing)")
    ap.add_argument("--name", default=None, help="model name in the repository (default: the file's stem)")
    ap.add_argument("--version", type=int, default=1, help="the model version folder in the repository")
    ap.add_argument("--max-batch-size", type=int, default=8, help="Triton's max_batch_size; 0 turns batching off")
    ap.add_argument("--queue-delay-us", type=int, default=2000, help="dynamic batcher's wait for company")
    ap.add_argument("--instances", type=int, default=1, help="model instances per device")
    ap.add_argument("--gpu", action="store_true", help="instances on GPUs (KIND_GPU) instead of CPUs")
    ap.add_argument("--tensorrt", action="store_true", help="ask the onnxruntime backend for its TensorRT EP")
    ap.add_argument("--mount", default=None,
                    help="where the server sees the repository (e.g. /models in Triton's container): a fused graph's "
                         "config names its operator library by that path (default: the repository's path here)")
    ap.add_argument("--pictures", action="store_true",
                    help="also <name>_pre/_post (Python backend: decoding, resizing, post-processing) and the "
                         "ensemble <name>_pictures: encoded picture bytes in, instances (JSON) out")
    args = ap.parse_args(argv)
    try:
        folder = write_repository(args.model, args.repo, args.name, args.version, mount=args.mount,
                                  max_batch_size=args.max_batch_size, queue_delay_us=args.queue_delay_us,
                                  instances=args.instances, kind="KIND_GPU" if args.gpu or args.tensorrt else "KIND_CPU",
                                  tensorrt=args.tensorrt)
        if args.pictures:
            write_picture_models(args.model, args.repo, folder.name, args.version, max_batch_size=args.max_batch_size,
                                 queue_delay_us=args.queue_delay_us, instances=args.instances)
    except (OSError, ValueError) as e:
        print(f"d2export triton-repo: error: {e}", file=sys.stderr)
        return 2
    print(folder / "config.pbtxt")
    return 0
