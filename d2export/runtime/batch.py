"""`d2export batch MODEL INPUT OUTPUT`: offline inference over a picture corpus on Ray Data, one row per picture.

    list INPUT (folder, glob or list file; local or any pyarrow filesystem), drop what OUTPUT already holds
    → Ray tasks read, decode and resize (the predictor's own `Processing.prepare`)
    → an actor pool runs the graph (one onnxruntime session per actor, `--threads` each) and post-processes
    → Ray Data writes OUTPUT/*.parquet or *.jsonl: path, height, width, instances, error; for a segmentation model
      also a column per served kind of the picture (d2export/served_kinds/): semantic and panoptic (PNG bytes; in
      JSON lines base64, as `d2export serve` answers) and segments (JSON)

A picture that cannot be read or decoded becomes a row with its error, never a failed job. Rows are written as blocks
finish, so an interrupted run leaves complete files behind; a rerun skips the pictures they hold (and removes a file
cut off mid-write). Pictures are batched only with pictures of their resized size: zero-padding changes a detector's
answers, and every row must be the answer `d2export infer` gives for that picture alone.

The same command runs on one machine (a local Ray started for the run) and on a cluster (`--address`): the model
travels through Ray's object store; pictures and OUTPUT must be where every node reaches them (s3://, gs://, NFS).
"""
from __future__ import annotations

import json
import math
import os
import posixpath
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from fsspec.utils import glob_translate

from d2export.argparsing import parser
from d2export.manifest import manifest_path
from d2export.runtime.image_decoding import IMAGE_SUFFIXES, decode_image
from d2export.runtime.model_loading import load_manifest
from d2export.runtime.processing import Prepared, Processing
from d2export.runtime.providers import PROVIDERS, ProviderUnavailable, resolve_providers
from d2export.runtime.serving_arguments import add_predictor_arguments
from d2export.served_kinds import kinds

FORMATS = {"parquet": ".parquet", "jsonl": ".jsonl"}
DECODE_CPUS = 0.5  # Ray CPUs per decoding task


def kind_columns() -> list:
    """The served kinds with a column of their own (per picture, in order): a file form's PNG bytes ("binary"), or
    the JSON form as text ("string"); per-instance kinds ride in `instances`."""
    return [k for k in kinds("picture") if k.column is not None]


def row_schema(maps: bool = False):
    """The rows' columns; `maps`: a segmentation model's too (`kind_columns`: the PNG files `infer` writes, and the
    panoptic map's segments as JSON), only then, so other models' files stay as they were."""
    import pyarrow as pa

    columns = [("path", pa.string()), ("height", pa.int64()), ("width", pa.int64()), ("instances", pa.string()),
               ("error", pa.string())]
    if maps:
        columns += [(k.name, getattr(pa, k.column)()) for k in kind_columns()]
    return pa.schema(columns)


# where the pictures are -----------------------------------------------------------------------------------------------
def filesystem(uri: str):
    """A path or URI → (pyarrow filesystem, the path within it, the prefix that turns such paths back into URIs)."""
    from pyarrow import fs

    if "://" not in uri:
        uri = os.path.abspath(uri)
    uri = uri.rstrip("/") or "/"
    filesys, path = fs.FileSystem.from_uri(uri)
    prefix = uri[: len(uri) - len(path)] if uri.endswith(path) else ""
    return filesys, path, prefix


def _walk(filesys, folder: str) -> list[str]:
    from pyarrow import fs

    infos = filesys.get_file_info(fs.FileSelector(folder, recursive=True))
    return sorted(i.path for i in infos if i.type == fs.FileType.File)


def list_pictures(source: str) -> list[str]:
    """INPUT → the pictures' URIs (absolute paths for local files), sorted within a folder or glob. A folder gives
    every picture below it (by suffix); a glob the files it matches (`**` for any folders below); any other file is a
    list of pictures, one a line (blank lines and `#` comments skipped, relative entries taken from the list's folder)."""
    from pyarrow import fs

    magic = next((i for i, c in enumerate(source) if c in "*?["), None)
    if magic is not None:
        base = source[: source.rfind("/", 0, magic) + 1]  # the folders before the first wildcard
        filesys, folder, prefix = filesystem(base or ".")
        pattern = folder.rstrip("/") + "/" + source[len(base):]
        match = re.compile(glob_translate(pattern)).match
        found = [prefix + p for p in _walk(filesys, folder) if match(p)]
        if not found:
            raise FileNotFoundError(f"no file matches {source}")
        return found
    filesys, path, prefix = filesystem(source)
    kind = filesys.get_file_info(path).type
    if kind == fs.FileType.Directory:
        return [prefix + p for p in _walk(filesys, path) if posixpath.splitext(p)[1].lower() in IMAGE_SUFFIXES]
    if kind != fs.FileType.File:
        raise FileNotFoundError(f"no such file or folder: {source}")
    if posixpath.splitext(path)[1].lower() in IMAGE_SUFFIXES:
        return [prefix + path]
    with filesys.open_input_stream(path) as f:
        lines = f.read().decode("utf-8").splitlines()
    folder = posixpath.dirname(path)
    entries = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    return [e if "://" in e or posixpath.isabs(e) else prefix + posixpath.normpath(posixpath.join(folder, e))
            for e in entries]


# what OUTPUT already holds --------------------------------------------------------------------------------------------
def _read_rows(filesys, path: str, fmt: str) -> list[dict[str, Any]]:
    """path and error of each row of one output file; raises if the file is incomplete."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=["path", "error"], filesystem=filesys).to_pylist()
    with filesys.open_input_stream(path) as f:
        text = f.read().decode("utf-8")
    if text and not text.endswith("\n"):
        raise ValueError("last line is cut off")
    return [json.loads(line) for line in text.splitlines()]


def written_rows(output: str, fmt: str) -> dict[str, bool]:
    """The pictures OUTPUT's files hold → whether their row is an error. A file that cannot be read whole was cut off
    by an interrupted run: it is removed and its pictures are done again."""
    from pyarrow import fs

    filesys, folder, _ = filesystem(output)
    if filesys.get_file_info(folder).type == fs.FileType.NotFound:
        return {}
    done: dict[str, bool] = {}
    for path in _walk(filesys, folder):
        name = posixpath.basename(path)
        if not name.endswith(FORMATS[fmt]) or name.startswith((".", "_")):
            continue
        try:
            rows = _read_rows(filesys, path, fmt)
        except Exception as e:  # noqa: BLE001 - any reason a file cannot be read means it is incomplete
            print(f"d2export batch: removing {path}, cut off by an interrupted run ({e}); its pictures run again",
                  file=sys.stderr)
            filesys.delete_file(path)
            continue
        done.update((r["path"], r.get("error") is not None) for r in rows)
    return done


# the Ray stages ---------------------------------------------------------------------------------------------------
_FILESYSTEMS: dict[str, tuple[Any, str]] = {}  # scheme://host → (filesystem, URI prefix), per worker


def read_bytes(uri: str) -> bytes:
    """One file's bytes: local paths opened as `infer` opens them, URIs through pyarrow."""
    if "://" not in uri:
        with open(uri, "rb") as f:
            return f.read()
    host_end = uri.find("/", uri.index("://") + 3)
    key = uri if host_end < 0 else uri[:host_end]
    if key not in _FILESYSTEMS:
        filesys, _, prefix = filesystem(uri)
        _FILESYSTEMS[key] = filesys, prefix
    filesys, prefix = _FILESYSTEMS[key]
    with filesys.open_input_stream(uri[len(prefix):]) as f:
        return f.read()


def prepare_pictures(batch: dict[str, np.ndarray], processing: Processing) -> dict[str, np.ndarray]:
    """Ray task: paths → the graph's inputs (CHW, resized) and original sizes, or each picture's error ("" for none:
    a column of Nones does not survive Ray's conversions as strings)."""
    chws, heights, widths, errors = [], [], [], []
    for uri in batch["path"]:
        try:
            prepared = processing.prepare(decode_image(read_bytes(uri)), "RGB")
            chws.append(prepared.chw)
            heights.append(prepared.height)
            widths.append(prepared.width)
            errors.append("")
        except Exception as e:  # noqa: BLE001 - one bad picture must not fail a job over millions
            chws.append(np.zeros((3, 0, 0), np.uint8))
            heights.append(-1)
            widths.append(-1)
            errors.append(str(e) or type(e).__name__)
    chw = np.empty(len(chws), dtype=object)
    chw[:] = chws
    return {"path": batch["path"], "chw": chw, "height": np.array(heights, np.int64),
            "width": np.array(widths, np.int64), "error": np.array(errors, dtype=object)}


@dataclass
class ModelFiles:
    """The model and its manifest as bytes, so actors on any node can load it."""

    name: str
    files: dict[str, bytes]

    @classmethod
    def read(cls, model_path: str | os.PathLike) -> "ModelFiles":
        model_path = Path(model_path)
        paths = (model_path, manifest_path(model_path))
        return cls(model_path.name, {p.name: p.read_bytes() for p in paths if p.exists()})  # a lone model: itself


class InferActor:
    """Ray actor: one onnxruntime session; batches of prepared pictures → output rows."""

    def __init__(self, model: Any, providers: list[str], threads: int, score_threshold: float | None,
                 min_size: int | None, max_size: int | None, verify_hash: bool = True, embedded_manifest: bool = False,
                 tf32: bool = False, cuda_graph: bool = False):
        import ray

        from d2export.runtime.predictor import Predictor

        model = ray.get(model[0])  # a reference in a list, so Ray hands it over unresolved and it is fetched once
        self.folder = tempfile.TemporaryDirectory(prefix="d2export-batch-")
        for name, data in model.files.items():
            Path(self.folder.name, name).write_bytes(data)
        self.predictor = Predictor(Path(self.folder.name, model.name), providers, threads, score_threshold,
                                   min_size=min_size, max_size=max_size, verify_hash=verify_hash,
                                   embedded_manifest=embedded_manifest, tf32=tf32, cuda_graph=cuda_graph)
        self.maps = self.predictor.family.pixel_maps

    def __call__(self, batch: dict[str, np.ndarray]):
        import pyarrow as pa

        from d2export.runtime.maps import map_pngs

        n = len(batch["path"])
        instances: list[str | None] = [None] * n
        extra: dict[str, list[bytes | str | None]] = {k.name: [None] * n for k in kind_columns()} if self.maps else {}
        errors = [str(e) or None for e in batch["error"]]
        ok = [i for i in range(n) if errors[i] is None]
        prepared = [Prepared(batch["chw"][i], int(batch["height"][i]), int(batch["width"][i])) for i in ok]
        for j, prediction in enumerate(self.predictor.predict_unpadded(prepared)):
            d = prediction.to_dict()
            instances[ok[j]] = json.dumps(d["instances"], ensure_ascii=False)
            if self.maps:
                pngs = map_pngs(prediction)
                for kind in kind_columns():
                    if kind.png is not None:
                        extra[kind.name][ok[j]] = pngs.get(kind.name)
                    elif kind.name in d:
                        extra[kind.name][ok[j]] = json.dumps(d[kind.name], ensure_ascii=False)
        heights = [None if e else int(h) for e, h in zip(errors, batch["height"])]
        widths = [None if e else int(w) for e, w in zip(errors, batch["width"])]
        columns = [list(batch["path"]), heights, widths, instances, errors]
        return pa.table(columns + list(extra.values()), schema=row_schema(self.maps))


def jsonl_datasink(output: str, rows_per_file: int):
    """Ray Data datasink writing `infer`'s lines: instances nested, absent fields left out, a segmentation model's maps
    as `d2export serve` answers them (base64 PNG) (the class is made here, so importing this module needs no Ray)."""
    import base64

    from ray.data.datasource import BlockBasedFileDatasink

    class JsonLines(BlockBasedFileDatasink):
        def write_block_to_file(self, block, file) -> None:
            lines = []
            for row in block.to_arrow().to_pylist():
                line = ({"path": row["path"], "error": row["error"]} if row["error"] is not None else
                        {"path": row["path"], "height": row["height"], "width": row["width"],
                         "instances": json.loads(row["instances"])})
                for kind in kind_columns():
                    value = row.get(kind.name)
                    if value is None:
                        continue
                    line[kind.name] = ({"shape": [row["height"], row["width"]],  # a file form: a pixel map
                                        "png_base64": base64.b64encode(value).decode("ascii")}
                                       if kind.png is not None else json.loads(value))
                lines.append(json.dumps(line, ensure_ascii=False) + "\n")
            file.write("".join(lines).encode("utf-8"))

    return JsonLines(output, file_format="jsonl", min_rows_per_file=rows_per_file)


# the job ----------------------------------------------------------------------------------------------------------
@dataclass
class Summary:
    total: int  # pictures listed
    skipped: int  # already in OUTPUT
    written: int  # by this run
    errors: int  # error rows in OUTPUT
    seconds: float

    def line(self) -> str:
        rate = f", {self.written / self.seconds:.1f} pictures/s" if self.written and self.seconds > 0 else ""
        return (f"{self.total} pictures: {self.skipped} already written, {self.written} now in {self.seconds:.1f} s"
                f"{rate}; {self.errors} rows with errors")


def connect(address: str | None, cpus_needed: float) -> None:
    """Ray as asked: an existing connection, a cluster address, or a local Ray with enough CPUs declared for the
    actors and decoding (declared CPUs are Ray's scheduling budget: on a small machine the stages share cores)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ray.init(num_cpus=max(cores, math.ceil(cpus_needed)), include_dashboard=False)


def dataset(pictures: list[str], model_ref: Any, processing: Processing, actors: int, batch_size: int,
            session: dict[str, Any]):
    """The Ray Data pipeline from picture URIs to output rows. `session`: the actors' Predictor arguments."""
    import ray.data

    gpu = any(PROVIDERS.get(p.lower(), p) != PROVIDERS["cpu"] for p in session["providers"])
    ds = ray.data.from_items([{"path": p} for p in pictures],
                             override_num_blocks=max(1, min(len(pictures) // batch_size, 10 * actors + 10)))
    # half a CPU per decoding task: reading waits on storage, and resources unlike the actors' keep Ray from fusing
    # decoding into them (it fuses consecutive maps of equal resources), so decoding scales on its own
    ds = ds.map_batches(prepare_pictures, fn_kwargs={"processing": processing}, batch_size=batch_size,
                        num_cpus=DECODE_CPUS)
    return ds.map_batches(InferActor, batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=actors),
                          fn_constructor_kwargs={"model": [model_ref], **session},
                          num_cpus=session["threads"], num_gpus=1 if gpu else 0)


def run(model: str | os.PathLike, source: str, output: str, *, fmt: str = "parquet", actors: int | None = None,
        batch_size: int = 8, address: str | None = None, rows_per_file: int = 1000, threads: int = 1,
        providers: Iterable[str] = ("cpu",), score_threshold: float | None = None, min_size: int | None = None,
        max_size: int | None = None, verify_hash: bool = True, embedded_manifest: bool = False,
        tf32: bool = False, cuda_graph: bool = False) -> Summary:
    """The whole job; see the module's docstring. `actors` None: as many as the CPUs hold, one kept for decoding."""
    import ray

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if min(threads, batch_size, rows_per_file, actors or 1) < 1:
        raise ValueError("--threads, --batch-size, --actors and --rows-per-file must be at least 1")
    session = {"providers": list(providers), "threads": threads, "score_threshold": score_threshold,
               "min_size": min_size, "max_size": max_size, "verify_hash": verify_hash,
               "embedded_manifest": embedded_manifest, "tf32": tf32, "cuda_graph": cuda_graph}
    # the actors check the model against its manifest; here the manifest only has to be read
    processing = Processing(load_manifest(Path(model), False, embedded_manifest), score_threshold, min_size, max_size)
    if address is None:  # the actors share this machine's onnxruntime (a cluster's may differ: its actors check)
        resolve_providers(session["providers"])
    pictures = list_pictures(source)
    start = time.perf_counter()
    done = written_rows(output, fmt)
    todo = [p for p in pictures if p not in done]
    if todo:
        connect(address, (actors or 1) * threads + DECODE_CPUS)
        cpus = ray.cluster_resources().get("CPU", 0)
        actors = actors or max(1, int(cpus - 1) // threads)
        if address is None and cpus < actors * threads + DECODE_CPUS:
            raise ValueError(f"{actors} actors x {threads} threads and a decoding task need "
                             f"{actors * threads + DECODE_CPUS} CPUs; this Ray has {cpus:g}")
        ds = dataset(todo, ray.put(ModelFiles.read(model)), processing, actors, batch_size, session)
        if fmt == "parquet":
            ds.write_parquet(output, min_rows_per_file=rows_per_file)
        else:
            ds.write_datasink(jsonl_datasink(output, rows_per_file))
        done = written_rows(output, fmt)
    return Summary(len(pictures), len(pictures) - len(todo), len(todo), sum(done.values()),
                   time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = parser("d2export batch", "Offline inference over a picture corpus on Ray Data: one row per picture (Parquet or "
                "JSON lines); a rerun resumes.", conflict_handler="resolve")  # --threads below replaces the shared one
    add_predictor_arguments(ap)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per actor (default 1)")
    ap.add_argument("input", help="a folder, a glob, or a list file (one picture a line); local or s3://, gs://, …")
    ap.add_argument("output", help="the folder the rows go to (parquet or jsonl files); a rerun skips what it holds")
    ap.add_argument("--format", choices=list(FORMATS), default="parquet", help="how rows are written")
    ap.add_argument("--address", default=None, help="Ray cluster: auto, ray://host:10001, … (default: a local Ray)")
    ap.add_argument("--actors", type=int, default=None, help="onnxruntime sessions (default: as many as the CPUs "
                                                              "hold, one CPU kept for decoding)")
    ap.add_argument("--batch-size", type=int, default=8, help="pictures per session run (equal sizes only)")
    ap.add_argument("--rows-per-file", type=int, default=1000, help="rows gathered before a file is written")
    args = ap.parse_args(argv)
    try:
        summary = run(args.model, args.input, args.output, fmt=args.format, actors=args.actors,
                      batch_size=args.batch_size, address=args.address, rows_per_file=args.rows_per_file,
                      threads=args.threads, providers=args.providers.split(","), score_threshold=args.score_threshold,
                      min_size=args.min_size, max_size=args.max_size, verify_hash=not args.no_verify_hash,
                      embedded_manifest=args.embedded_manifest, tf32=args.tf32, cuda_graph=args.cuda_graph)
    except (OSError, ValueError, ProviderUnavailable) as e:
        print(f"d2export batch: error: {e}", file=sys.stderr)
        return 2
    print(f"d2export batch: {summary.line()}", file=sys.stderr)
    return 0
