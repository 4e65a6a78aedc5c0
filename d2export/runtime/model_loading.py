"""A model file and its manifest loaded and checked to be the pair they claim to be (the manifest beside the model,
its sha256, the graph's inputs and outputs), or a one-line `ModelLoadError` naming the file."""
from __future__ import annotations

from pathlib import Path

from d2export.manifest import Manifest, manifest_path, sha256_file

ORT_TYPE_NAMES = {"float32": "float", "float64": "double"}  # numpy dtype names onnxruntime spells otherwise


class ModelLoadError(ValueError):
    """The model or its manifest is missing, unreadable or not the pair they claim to be: one line, naming the file."""


def load_manifest(model_path: Path, verify_hash: bool = True, embedded: bool = False) -> Manifest:
    """The manifest beside `model_path`, checked to describe that very file (by sha256 unless told not to); with
    `embedded`, a model without one beside it answers with the copy inside it."""
    if not model_path.is_file():
        raise ModelLoadError(f"model file not found: {model_path}")
    path = manifest_path(model_path)
    if embedded and not path.exists():
        return Manifest.from_model(model_path)
    if not path.is_file():
        raise ModelLoadError(f"{model_path} has no manifest beside it ({path.name} not found; an export into that "
                             "folder may have been interrupted: rerun it)")
    try:
        manifest = Manifest.read(path)
    except (ValueError, TypeError, KeyError) as e:  # bad JSON, missing or unknown fields
        raise ModelLoadError(f"{path}: not a readable d2export manifest ({type(e).__name__}: {e})") from None
    if verify_hash:
        actual = sha256_file(model_path)
        if manifest.sha256 != actual:
            raise ModelLoadError(f"{model_path} is not the model {path.name} describes: sha256 {actual[:16]}… vs "
                                 f"{(manifest.sha256 or 'none')[:16]}… recorded (pass --no-verify-hash to skip)")
    return manifest


def check_schema(model_path: Path, manifest: Manifest, session) -> None:
    """The graph's inputs and outputs must be the manifest's: names, element types and ranks."""
    def ours(specs):
        return [(t.name, f"tensor({ORT_TYPE_NAMES.get(t.dtype, t.dtype)})", len(t.shape)) for t in specs]

    def theirs(args):
        return [(a.name, a.type, len(a.shape)) for a in args]

    for kind, want, got in (("inputs", ours(manifest.inputs), theirs(session.get_inputs())),
                            ("outputs", ours(manifest.outputs), theirs(session.get_outputs()))):
        if want != got:
            diff = next((w, g) for w, g in zip(want + [None] * len(got), got + [None] * len(want)) if w != g)
            raise ModelLoadError(f"{model_path}: graph {kind} differ from {manifest_path(model_path).name} "
                                 f"(manifest {diff[0]}, graph {diff[1]})")
