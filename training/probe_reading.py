"""Where a text spotter misreads: the words of a labelled set grouped by shape (straight, rotated, curved), glyph
height and length, each group's share found (matched at IoU > 0.5, as the text evaluator matches), its character
accuracy and words read whole among those found; then substitutions by character position and the commonest
confusions. Where the evaluator gives one figure, this says which words cost it, and so what would mend them.

    python training/probe_reading.py --weights tests/data/spotter_fixture.pth --data outputs/decoder/validation
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party")]
from training.common import cpu_spotter, reading  # noqa: E402

BEND = 0.02  # a top edge straying from its chord by more than this share of the chord's length is curved
TILT = 3.0  # degrees from the horizontal past which a straight word is rotated
HEIGHTS = (0, 10, 14, 18, 24, math.inf)  # word-height bins, in the picture's pixels
LENGTHS = (1, 3, 5, 7, 9, math.inf)


def outline_geometry(points) -> tuple[str, float]:
    """An outline of 2n points, the top edge left to right then the bottom right to left (AdelaiDet's polygons):
    "curved", "rotated" or "straight", and its height in pixels (the mean distance between opposite points)."""
    p = np.asarray(points, np.float64).reshape(-1, 2)
    top, bottom = p[:len(p) // 2], p[len(p) // 2:][::-1]
    chord = top[-1] - top[0]
    length = float(np.hypot(*chord)) or 1.0
    normal = np.array([-chord[1], chord[0]]) / length
    bend = float(np.abs((top - top[0]) @ normal).max()) / length
    tilt = math.degrees(math.atan2(abs(chord[1]), abs(chord[0])))
    kind = "curved" if bend > BEND else "rotated" if tilt > TILT else "straight"
    return kind, float(np.linalg.norm(top - bottom, axis=1).mean())


def row(truth, said: str | None) -> dict:
    """One word of the set: its geometry, and what the spotter read there (None: not found)."""
    from d2export.evaluating.text_metrics import edits

    kind, height = outline_geometry(truth.points)
    text = truth.text.upper()
    read = None if said is None else said.upper()
    return {"kind": kind, "height": height, "length": len(text), "truth": text, "said": read,
            "errors": None if read is None else min(edits(read, text), len(text))}


def summary(rows: list[dict]) -> dict:
    """Words, % found, and among those found: % of characters and of words read whole, % read at another length."""
    found = [r for r in rows if r["said"] is not None]
    chars = sum(r["length"] for r in found)

    def share(n, of):
        return round(100.0 * n / of, 1) if of else None

    return {"words": len(rows), "found": share(len(found), len(rows)),
            "chars": share(chars - sum(r["errors"] for r in found), chars),
            "whole": share(sum(r["said"] == r["truth"] for r in found), len(found)),
            "other_length": share(sum(len(r["said"]) != r["length"] for r in found), len(found))}


def breakdown(rows: list[dict]) -> dict:
    """The figures of `summary` for all words and by group; substitutions by position (words read at their length)."""

    def bins(key, edges, last):  # lengths are whole: 3-4; heights are not: 10-14 holds 13.9
        return {f"{lo:g}+" if hi == math.inf else f"{lo:g}-{hi - last:g}": summary(
            [r for r in rows if lo <= r[key] < hi]) for lo, hi in zip(edges, edges[1:])}

    same = [r for r in rows if r["said"] is not None and len(r["said"]) == r["length"]]
    at, wrong = collections.Counter(), collections.Counter()
    for r in same:
        for i, (s, t) in enumerate(zip(r["said"], r["truth"])):
            at[i] += 1
            wrong[i] += s != t
    confusions = collections.Counter(f"{t}>{s}" for r in same for s, t in zip(r["said"], r["truth"]) if s != t)
    return {"all": summary(rows),
            "shape": {k: summary([r for r in rows if r["kind"] == k]) for k in ("straight", "rotated", "curved")},
            "height_px": bins("height", HEIGHTS, 0), "length": bins("length", LENGTHS, 1),
            "substituted_at": {i: round(100.0 * wrong[i] / at[i], 1) for i in sorted(at)},
            "confusions": dict(confusions.most_common(12))}


def print_table(figures: dict) -> None:
    print(f"{'':16s} {'words':>6s} {'found':>6s} {'chars':>6s} {'whole':>6s} {'other length':>13s}  (%)")
    for group in ("all", "shape", "height_px", "length"):
        items = [(group, figures[group])] if group == "all" else [(f"{group} {k}", v) for k, v in figures[group].items()]
        for name, s in items:
            print(f"{name:16s} {s['words']:6d} " + " ".join(f"{'-' if s[k] is None else s[k]:>{w}}" for k, w in
                                                            (("found", 6), ("chars", 6), ("whole", 6), ("other_length", 13))))
    print("substituted at position (%):", figures["substituted_at"])
    print("commonest confusions (truth>read):", figures["confusions"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro_spotter.yaml"))
    ap.add_argument("--weights", default=str(REPO / "tests/data/spotter_fixture.pth"))
    ap.add_argument("--data", required=True, help="a labelled text set (d2export synth text, or AdelaiDet's format)")
    ap.add_argument("--count", type=int, default=0, help="its first pictures only (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="the figures written here too")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs (INPUT.MIN_SIZE_TEST 416)")
    args = ap.parse_args(argv)

    import torch

    cfg, model = cpu_spotter(args.config, args.overrides, args.threads, args.weights)
    from detectron2.data import DatasetCatalog, MetadataCatalog
    from testr.data import DatasetMapperWithBasis

    from d2export.datasets import register
    from d2export.evaluating.evaluators import detected_words, ground_truth_words
    from d2export.evaluating.text_metrics import matches
    from d2export.progress import steps

    model.eval()
    register("probe_reading", Path(args.data))
    records = DatasetCatalog.get("probe_reading")[:args.count or None]
    voc_size = int(getattr(MetadataCatalog.get("probe_reading"), "voc_size", 96))
    mapper, post, rows = DatasetMapperWithBasis(cfg, is_train=False), reading(cfg), []
    with torch.no_grad():
        for record in steps(records, "reading"):
            truth = ground_truth_words(record, voc_size)
            found = [word for _, word in detected_words(model([mapper(record)])[0]["instances"], post)]
            said = dict(matches(truth, found)[0])
            rows += [row(w, found[said[i]].text if i in said else None) for i, w in enumerate(truth)
                     if w.text != "###"]
    figures = breakdown(rows)
    print_table(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
