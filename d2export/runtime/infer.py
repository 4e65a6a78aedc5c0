"""`d2export infer MODEL IMAGE_OR_FOLDER …`: one JSON line per picture (its file, size and instances), pictures of the
results with --vis; a segmentation model's pixel maps as PNG files (--maps) that its line names. A picture that fails,
for whatever reason, gets a line with its error and the rest are still processed; the exit status is then 1."""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator

from d2export.argparsing import parser
from d2export.runtime.image_decoding import IMAGE_SUFFIXES, BadImage, read_image
from d2export.runtime.providers import ProviderUnavailable
from d2export.runtime.serving_arguments import add_predictor_arguments, predictor_from_args
from d2export.served_kinds import kinds


def image_files(paths: Iterable[str]) -> list[Path]:
    """Files as given; folders searched recursively for image suffixes, in sorted order."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


def _progress(items: list, enabled: bool) -> Iterator:
    if not enabled:
        return iter(items)
    try:
        from tqdm import tqdm
    except ImportError:
        return iter(items)
    return iter(tqdm(items, unit="img", file=sys.stderr))


def shown(path: Path) -> str:
    """A path as text that always encodes: bytes that are not UTF-8 (kept by Python as surrogates) as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _unique(stem: str, used: set[str]) -> str:
    """A safe `stem` (letters, digits, `_-.` only, no leading dot), or `stem_1`, … where folders hold pictures of the
    same name: the picture's files are `<stem>.png` (--vis) and a file per served kind with one (`<stem>.semantic.png`,
    `<stem>.panoptic.png`)."""
    stem = re.sub(r"[^\w.-]", "_", shown(Path(stem))).lstrip(".") or "image"
    name, i = stem, 0
    while name in used:
        i += 1
        name = f"{stem}_{i}"
    used.add(name)
    return name


def maps_folder(maps: str | None, output: str, vis: str | None) -> Path:
    """Where pixel maps go: --maps; else beside the -o file; else (stdout) the --vis folder; else ./maps."""
    if maps:
        return Path(maps)
    if output != "-":
        return Path(output).parent
    return Path(vis) if vis else Path("maps")


def _file_kinds() -> list:
    return [k for k in kinds("picture") if k.png is not None]


def has_maps(result) -> bool:
    """Whether the prediction holds a served kind that is written as a file (a segmentation model's pixel maps)."""
    return any(getattr(result, k.name) is not None for k in _file_kinds())


def write_maps(result, folder: Path, stem: str) -> dict[str, dict]:
    """The prediction's served kinds with a file form as `<folder>/<stem><suffix>` (`<stem>.semantic.png`, …: see
    d2export/served_kinds/); their JSON entries, each its JSON form naming its file."""
    entries = {}
    for kind in _file_kinds():
        value = getattr(result, kind.name)
        if value is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{stem}{kind.png.suffix}"
        path.write_bytes(kind.png.encode(value))
        entries[kind.name] = kind.to_json(value) | {"png": shown(path)}
    return entries


def _maps_help() -> str:
    suffixes = [k.png.suffix for k in _file_kinds()]
    files = " and ".join([", ".join(suffixes[:-1]), suffixes[-1]] if len(suffixes) > 1 else suffixes)
    return (f"segmentation models: write <DIR>/<name>{files} (default: the -o file's folder; with stdout, the --vis "
            "folder, else ./maps)")


def main(argv: list[str] | None = None) -> int:
    ap = parser("d2export infer", __doc__.split("\n\n")[0].replace("\n", " "))
    add_predictor_arguments(ap)
    ap.add_argument("inputs", nargs="+", help="image files and/or folders")
    ap.add_argument("-o", "--output", default="-", help="JSON lines file (-: stdout)")
    ap.add_argument("--vis", default=None, metavar="DIR", help="write <DIR>/<name>.png with outlines and labels (default: no pictures)")
    ap.add_argument("--maps", default=None, metavar="DIR",
                    help=_maps_help())
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        files = image_files(args.inputs)
        predictor = predictor_from_args(args)
    except (OSError, ValueError, ProviderUnavailable) as e:
        print(f"d2export infer: error: {e}", file=sys.stderr)
        return 2
    if predictor.providers != ["CPUExecutionProvider"]:  # asked for more than the CPU: say what really runs
        print(f"d2export infer: {predictor.providers_line()}", file=sys.stderr)
    vis = Path(args.vis) if args.vis else None
    if vis:
        vis.mkdir(parents=True, exist_ok=True)
        from d2export.runtime.visualize import draw_prediction
    maps = maps_folder(args.maps, args.output, args.vis)
    class_names = predictor.post.get("class_names")
    failed, used = 0, set()
    show_bar = not args.no_progress and (len(files) > 1 or any(Path(p).is_dir() for p in args.inputs))
    with contextlib.ExitStack() as stack:
        out = sys.stdout if args.output == "-" else stack.enter_context(open(args.output, "w", encoding="utf-8"))
        for f in _progress(files, show_bar):
            try:
                image = read_image(f)
                result = predictor.predict(image)
                line = {"file": shown(f)} | result.to_dict()
                with_maps = has_maps(result)
                stem = _unique(f.stem, used) if vis or with_maps else None
                if with_maps:
                    line.update(write_maps(result, maps, stem))
                if vis:
                    draw_prediction(image, result, class_names=class_names).save(vis / f"{stem}.png", format="PNG")
            except Exception as e:  # noqa: BLE001 - one picture never ends the run: its line says why
                failed += 1
                why = str(e) if isinstance(e, (OSError, BadImage)) else f"{type(e).__name__}: {e}"
                line = {"file": shown(f), "error": why.encode("utf-8", "backslashreplace").decode()}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
    if failed:
        print(f"d2export infer: {failed} of {len(files)} pictures failed (see their 'error' lines)", file=sys.stderr)
    return 1 if failed else 0
