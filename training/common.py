"""What the training tools share: the TESTR stand-in as they build and run it, its evaluation, the record a fixture
is published with, and the glyph loss that keeps characters in the spotter's features.

Every script here imports it; it imports none of them (no script imports another). Heavy imports stay inside the
functions, so a script's --help does not load torch.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------- the model
def spotter_cfg(config: str, overrides: list[str], threads: int | None, seed: int = 0):
    """The TESTR stand-in as every spotter tool runs it: TESTR's CUDA op stood in for (on any device, with a
    backward), `threads` CPU threads (None: torch's default), torch seeded, the model registered; returns `config`
    with `overrides`."""
    import torch

    from d2export.patching import compiled_ops

    compiled_ops.install(["testr._C"])
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    import testr  # noqa: F401 - registers TransformerDetector
    from testr.config import get_cfg

    cfg = get_cfg()
    cfg.merge_from_file(config)
    cfg.merge_from_list(overrides)
    return cfg


def cpu_spotter(config: str, overrides: list[str], threads: int, weights: str | Path):
    """`config` as `spotter_cfg` makes it, on the CPU, with `weights`; returns (cfg, model)."""
    cfg = spotter_cfg(config, overrides, threads)  # first: it stands in for testr's compiled op before testr loads
    cfg.MODEL.DEVICE = "cpu"
    from detectron2.modeling import build_model
    from testr.train import load_checkpoint

    model = build_model(cfg)
    load_checkpoint(Path(weights), model)
    return cfg, model


def reading(cfg) -> dict:
    """How the evaluator reads the model's character slots (a manifest's `charset` and `text_decoding`)."""
    from d2export.charset import charset

    t = cfg.MODEL.TRANSFORMER
    return {"charset": "".join(charset(int(t.VOC_SIZE))), "text_decoding": "ctc" if t.TEXT_CTC else "slots"}


def decayed(lr: float, step: int, decay_at: int) -> float:
    """The rate of a step under `--decay-at`: a tenth of `lr` from step `decay_at` on (0: constant). The last steps at
    a tenth settle what a constant rate stirs (pretrain_glyphs, probe_decoder)."""
    return lr * (0.1 if decay_at and step >= decay_at else 1.0)


# ------------------------------------------------------------------------------------------ scoring and records
# Score thresholds the evaluation also reports the detection H-mean at: upstream's evaluation scripts tune
# INFERENCE_TH_TEST on the evaluated set, so its figures are at the best of such a sweep.
SWEEP = (0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6)


def evaluate(model, records, mapper_test, name, post):
    """The text evaluator's figures at the model's own score threshold, and the detection H-mean at each threshold
    of SWEEP ({threshold: H-mean}): the model runs once at the lowest, its detections filtered for the others."""
    import torch

    from d2export.evaluating.evaluators import TextSpottingEvaluator

    own = float(model.test_score_threshold)
    thresholds = sorted({own, *SWEEP})
    evaluator = TextSpottingEvaluator(name, post, thresholds)
    model.eval()
    model.test_score_threshold = thresholds[0]
    try:
        with torch.no_grad():
            for r in records:
                evaluator.process([r], model([mapper_test(r)]))
    finally:
        model.test_score_threshold = own
        model.train()
    figures = evaluator.evaluate()["text_by_threshold"]
    return figures[own], {f"{t:g}": f["det_hmean"] for t, f in figures.items()}


def init_lineage(path: Path) -> dict:
    """What a warm-started run began from: the weights' sha256 and, where one lies beside them, their record (so a
    fixture trained over several runs keeps every run's command, machine, time and curve)."""
    record = path.with_suffix(".json")
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            **({"record": json.loads(record.read_text())} if record.is_file() else {})}


def machine() -> str:
    import torch

    from d2export.cpu import describe_cpu

    gpu = f"; {torch.cuda.get_device_name()}" if torch.cuda.is_initialized() else ""
    return f"{describe_cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}"


def publish(model, cfg, snapshot: Path, path: Path, folder: Path, seed: int, count: int, size: str,
            record: dict) -> None:
    """A finished run's float16 `snapshot`, run in float32 as it ships, scored on `count` pictures of `seed` (a seed
    neither trained nor tuned on, drawn into `folder`), then copied to `path` with its record beside it: `record`
    (the command, the run's curve and training time, ...) and the held-out scores, the machine, sha256 and size."""
    import shutil

    from detectron2.data import DatasetCatalog
    from testr.data import DatasetMapperWithBasis
    from testr.train import load_checkpoint

    from d2export.datasets import generate, register
    from d2export.datasets.synth import parse_size

    if not (folder / "annotations.json").is_file():
        generate("text", folder, count=count, seed=seed, size=parse_size(size))
    register("synth_text_final", folder)
    load_checkpoint(snapshot, model)  # float16 values into the float32 model: what the fixture ships
    held_out, sweep = evaluate(model, DatasetCatalog.get("synth_text_final"), DatasetMapperWithBasis(cfg, False),
                               "synth_text_final", reading(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.copyfile(snapshot, tmp)
    tmp.replace(path)
    read_at = {"min_size": cfg.INPUT.MIN_SIZE_TEST, "max_size": cfg.INPUT.MAX_SIZE_TEST}  # what the scores depend on
    record = {**record, "held_out": {"count": count, "seed": seed, "size": size, "read_at": read_at, **held_out,
                                     "det_hmean_by_threshold": sweep},
              "machine": machine(), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
              "bytes": path.stat().st_size}
    path.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}, indent=2))


# ------------------------------------------------------------------------------------------------ the glyphs
def word_points(bezier_pts, rec, voc_size: int, chars: list[str]):
    """One word's character centres (pixels, [n, 2]) and class ids from its Bezier band and transcription ids; None
    and [] for a word without characters or with one the character set cannot name."""
    from d2export.charset import decode
    from d2export.datasets.text import glyph_points

    ids = [c for c in rec if c < voc_size]
    word = decode(ids, chars)
    if not ids or len(word) != len(ids):
        return None, []
    return glyph_points(bezier_pts, word), ids


def centres(instances, voc_size: int, chars: list[str]):
    """The mapped picture's character centres (pixels, [n, 2]) and their class ids [n] from its instances' Bezier
    bands and transcriptions."""
    import numpy as np
    import torch

    points, ids = [], []
    for bezier, text in zip(instances.beziers.numpy(), instances.text.tolist()):
        found, known = word_points(bezier, text, voc_size, chars)
        if known:
            points.append(found)
            ids += known
    if not ids:
        return torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)
    return torch.as_tensor(np.concatenate(points), dtype=torch.float32), torch.as_tensor(ids)


def read_glyphs(head, fmap, padded_wh, batch, voc_size: int, chars: list[str]):
    """`head`'s logits [n, voc_size] on `fmap` (B, C, h, w: a map spanning the padded pictures, `padded_wh` pixels)
    at every character centre of `batch` (mapped records), and their labels [n]."""
    import torch
    import torch.nn.functional as F

    scale = fmap.new_tensor([float(padded_wh[0]), float(padded_wh[1])])
    logits, labels = [], []
    for b, record in enumerate(batch):
        points, ids = centres(record["instances"], voc_size, chars)
        if not len(ids):
            continue
        grid = points.to(fmap.device) / scale * 2 - 1  # align_corners=False: the map spans the padded picture's edges
        sampled = F.grid_sample(fmap[b:b + 1], grid[None, None].to(fmap.dtype), align_corners=False)[0, :, 0].T
        logits.append(head(sampled))
        labels.append(ids.to(fmap.device))
    if not logits:
        return fmap.new_zeros(0, voc_size), torch.zeros(0, dtype=torch.long, device=fmap.device)
    return torch.cat(logits), torch.cat(labels)


class GlyphLoss:
    """Keeps the spotter's features reading characters while it trains: a linear classifier (`head`, whose parameters
    the caller adds to its optimizer) reads each character at its glyph's centre from the finest level of the
    encoder's memory (`where="memory"`: what the text queries sample) or of the projected maps, and its cross-entropy
    times `weight` joins the training losses as "loss_glyphs". Measured: 1,017 spotter steps from pretrained weights
    without it took a linear probe of the memory from 30.1% to 23.9% of characters, of the projected map from 49.3% to
    41.6% — the spotter's own losses wear the characters out of its features."""

    def __init__(self, model, weight: float, where: str = "memory"):
        import torch

        from d2export.charset import charset

        self.voc_size = int(model.testr.voc_size)
        self.chars = charset(self.voc_size)
        proj = model.testr.input_proj
        self.head = torch.nn.Linear(proj[0][0].out_channels, self.voc_size).to(model.device)
        seen = {}
        self.hooks = [
            model.testr.backbone.register_forward_pre_hook(lambda m, a: seen.__setitem__("padded", a[0].tensor.shape)),
            proj[0].register_forward_hook(lambda m, i, o: seen.__setitem__("map", o)),
            model.testr.transformer.encoder.register_forward_hook(lambda m, i, o: seen.__setitem__("memory", o))]
        forward = model.forward

        def with_glyphs(batched_inputs):
            losses = forward(batched_inputs)
            if model.training:
                fmap = seen["map"]
                if where == "memory":  # [B, tokens, C], the levels flattened one after the other, the finest first
                    b, c, h, w = fmap.shape
                    fmap = seen["memory"][:, :h * w].transpose(1, 2).reshape(b, c, h, w)
                padded_h, padded_w = seen["padded"][-2:]
                logits, labels = read_glyphs(self.head, fmap, (padded_w, padded_h), batched_inputs, self.voc_size,
                                             self.chars)
                loss = torch.nn.functional.cross_entropy(logits, labels) if len(labels) else fmap.sum() * 0
                losses["loss_glyphs"] = loss * weight
            return losses

        model.forward = with_glyphs

    def join(self, optimizer, cfg) -> None:
        """The classifier learns at the spotter's base rate (add it before the schedule is built: it scales every
        group)."""
        optimizer.add_param_group({"params": list(self.head.parameters()), "lr": cfg.SOLVER.BASE_LR,
                                   "weight_decay": cfg.SOLVER.WEIGHT_DECAY})
