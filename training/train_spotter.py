"""Train the TESTR stand-in (third_party/testr) on `d2export synth text`, on the CPU (or a GPU: --device cuda): steps
2 and 4 of the micro spotter's recipe (docs/training.md).

The model code is the user's: d2export only provides the compiled attention op TESTR imports (its import hook, with
a backward), as it does for export. Seeded; resumable (run it again with the same --out: it goes on from
last.pth); a progress bar with the losses; every --eval-every iterations d2export's text evaluator (detection and
end-to-end H-mean) on the evaluation pictures; float16 weight snapshots of a few MB.

    python training/train_spotter.py --out outputs/spotter_overfit --train-count 32 --eval-on train --iters 400
    python training/train_spotter.py --out outputs/spotter --minutes 75

By default the training pictures are an endless stream drawn on the fly by --workers processes (picture i of the
stream is picture i of `d2export synth text --seed 0`; nothing is seen twice); --train-count N trains on a fixed
set of N pictures written to disk instead.

With --fixture, a run that has reached --iters scores its float16 weights (run in float32, as they ship) on
--final-count pictures of --final-seed, a seed neither trained nor tuned on, and writes them with their record
(sha256, command, machine, time, the curve, the held-out scores) beside them.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party")]
from training.common import GlyphLoss, evaluate, init_lineage, publish, reading, spotter_cfg  # noqa: E402


def batches(records, mapper, size, seed, start):
    """An endless, seeded stream of mapped batches; `start` skips what a resumed run already saw."""
    rng = random.Random(seed)
    order, step = [], 0
    while True:
        if len(order) < size:
            order += rng.sample(range(len(records)), len(records))
        picked, order = order[:size], order[size:]
        if step >= start:
            yield [mapper(records[i]) for i in picked]
        step += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro.yaml"), help="TESTR config")
    ap.add_argument("--out", default="outputs/spotter", help="checkpoints, metrics and the synthetic sets")
    ap.add_argument("--train-count", type=int, default=0,
                    help="train on a fixed set of this many pictures (0: an endless stream drawn on the fly)")
    ap.add_argument("--workers", type=int, default=2, help="processes drawing the stream's batches (0: this one)")
    ap.add_argument("--eval-count", type=int, default=100, help="held-out pictures (another seed)")
    ap.add_argument("--eval-seed", type=int, default=2,
                    help="seed of the pictures evaluated during training (tuning; keep another for final claims)")
    ap.add_argument("--eval-on", choices=["held_out", "train"], default="held_out",
                    help="evaluate on held-out pictures or on the training pictures (to check it can overfit)")
    ap.add_argument("--size", default="320x320", help="picture size")
    ap.add_argument("--iters", type=int, default=100000, help="stop after this many iterations")
    ap.add_argument("--minutes", type=float, default=0, help="or after this many minutes of this run (0: no limit)")
    ap.add_argument("--batch", type=int, default=0, help="pictures per step (default: SOLVER.IMS_PER_BATCH)")
    ap.add_argument("--eval-every", type=int, default=100, help="evaluate every N iterations")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch order")
    ap.add_argument("--init", default="", help="a new run starts from these weights (e.g. the committed fixture, "
                    "float16) instead of seeded ones; a resumed run ignores it")
    ap.add_argument("--fixture", default="", help="once --iters are done, write the float16 weights here, and "
                    "their record (.json) with the held-out scores")
    ap.add_argument("--final-seed", type=int, default=1, help="seed of the held-out pictures --fixture scores")
    ap.add_argument("--final-count", type=int, default=200, help="held-out pictures --fixture scores")
    ap.add_argument("--glyph-weight", type=float, default=0.0,
                    help="a linear classifier reads each glyph from the encoder's memory while the spotter trains, its "
                         "loss at this weight (training/common.py's GlyphLoss; 0: none)")
    ap.add_argument("--train", choices=["all", "text"], default="all",
                    help="text: only the text branch learns (its decoder layers, character classifier and slot "
                         "embeddings) on what the rest, frozen and in eval mode, sees; detection stays exactly as "
                         "--init had it. The last stage of the recipe: reading learns from many pictures cheaply")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, every core or $OMP_NUM_THREADS)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto (cuda where torch sees a GPU): the op's "
                    "stand-in runs there with its backward")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs as detectron2 takes them")
    args = ap.parse_args(argv)
    # what is refused is refused before the model, the pictures or detectron2 are loaded
    if args.train == "text" and args.glyph_weight:
        ap.error("--glyph-weight trains the features, which --train text keeps as they are")
    if args.eval_on == "train" and not args.train_count:
        ap.error("--eval-on train needs a fixed set: give --train-count")

    import numpy as np
    import torch
    from tqdm import tqdm

    if args.device != "cpu":
        from d2export.building import UserError, resolve_device
        from d2export.config import DEVICE_NAMES

        if not DEVICE_NAMES.fullmatch(args.device):
            ap.error(f"--device {args.device}: choose cpu, auto, cuda or cuda:N")
        try:
            args.device = resolve_device(args.device, option="--device ")
        except UserError as e:
            ap.error(str(e))
    out = Path(args.out)
    last = out / "last.pth"
    # memory-mapped: only its keys and the classifier are read here; load_checkpoint reads the rest
    state = torch.load(last, map_location="cpu", weights_only=False, mmap=True) if last.is_file() else {}
    if state and bool(args.glyph_weight) != ("glyph_head" in state):  # its optimizer has (or lacks) that group
        ap.error(f"{last} was trained {'without' if args.glyph_weight else 'with'} --glyph-weight: resume it the "
                 "same way or start a new --out")
    if state and state.get("train", "all") != args.train:  # its optimizer holds other parameters
        ap.error(f"{last} was trained with --train {state.get('train', 'all')}: resume it the same way or start a "
                 "new --out")

    cfg = spotter_cfg(args.config, args.overrides, args.threads, args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)  # detectron2's augmentations (the training sizes) draw from numpy's global generator
    from detectron2.modeling import build_model
    from detectron2.solver import build_lr_scheduler
    from testr.data import DatasetMapperWithBasis
    from testr.train import build_optimizer, load_checkpoint, save_checkpoint, save_weights_fp16, train_step

    from d2export.datasets import generate, register
    from d2export.datasets.synth import parse_size

    cfg.MODEL.DEVICE = args.device
    out.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.size)
    sets = {"train": ("synth_text_train", 0, args.train_count),
            "held_out": ("synth_text_held_out", args.eval_seed, args.eval_count)}
    for key, (name, seed, count) in sets.items():
        if not count:
            continue
        folder = out / "data" / key
        if not (folder / "annotations.json").is_file():
            generate("text", folder, count=count, seed=seed, size=size)
        register(name, folder)
    from detectron2.data import DatasetCatalog

    eval_name = sets[args.eval_on][0]
    eval_records = DatasetCatalog.get(eval_name)

    model = build_model(cfg)
    if args.train == "text":
        text_only(model)
    optimizer = build_optimizer(cfg, model)
    glyphs = None
    if args.glyph_weight:
        glyphs = GlyphLoss(model, args.glyph_weight)
        glyphs.join(optimizer, cfg)
    start = load_checkpoint(last, model, optimizer) if state else 0
    if glyphs and start:
        glyphs.head.load_state_dict(state["glyph_head"])
    del state
    if args.init and not start:
        load_checkpoint(Path(args.init), model)  # weights only: the optimizer and the schedule start anew
    lineage = init_lineage(Path(args.init)) if args.init else None  # read now: --fixture may overwrite it
    scheduler = build_lr_scheduler(cfg, optimizer)  # SOLVER.WARMUP_ITERS, STEPS, GAMMA, MAX_ITER as detectron2's
    for _ in range(start):  # a resumed run goes on at its iteration's learning rate
        scheduler.step()
    mapper = DatasetMapperWithBasis(cfg, is_train=True)
    mapper_test = DatasetMapperWithBasis(cfg, is_train=False)
    post = reading(cfg)
    clip = cfg.SOLVER.CLIP_GRADIENTS.CLIP_VALUE if cfg.SOLVER.CLIP_GRADIENTS.ENABLED else 0
    metrics = out / "metrics.jsonl"
    earlier = [json.loads(line) for line in metrics.read_text().splitlines()] if start and metrics.is_file() else []
    log = open(metrics, "a")
    began = time.time()
    started = began - max((r["seconds"] for r in earlier if r["iter"] <= start), default=0.0)  # one clock for all runs
    per_step = args.batch or cfg.SOLVER.IMS_PER_BATCH
    if args.train_count:
        stream = batches(DatasetCatalog.get(sets["train"][0]), mapper, per_step, args.seed, start)
    else:
        from functools import partial

        from testr.data.stream import stream as drawn

        from d2export.datasets.catalog import text_record

        stream = drawn(partial(text_record, 0, size=size), mapper, per_step, args.seed, start, args.workers)
    bar = tqdm(range(start, args.iters), initial=start, total=args.iters, desc="train", dynamic_ncols=True)
    it, waited_total = start, 0.0
    for it in bar:
        lr = optimizer.param_groups[-1]["lr"]
        waited = time.time()
        batch = next(stream)
        waited = time.time() - waited  # what the step waited for its pictures: ~0 when the workers keep up
        waited_total += waited
        losses = train_step(model, optimizer, batch, clip)
        scheduler.step()
        bar.set_postfix(total=f"{losses['total']:.2f}", ce=f"{losses['loss_ce']:.3f}",
                        pts=f"{losses['loss_ctrl_points']:.3f}", txt=f"{losses['loss_texts']:.3f}")
        row = {"iter": it + 1, "seconds": round(time.time() - started, 1), "lr": lr, "data_seconds": round(waited, 3),
               **{k: round(v, 4) for k, v in losses.items()}}
        done = it + 1 >= args.iters or (args.minutes and time.time() - began > args.minutes * 60)
        if (it + 1) % args.eval_every == 0 or done:
            row["eval"], row["sweep"] = evaluate(model, eval_records, mapper_test, eval_name, post)
            best = max(row["sweep"], key=row["sweep"].get)
            bar.write(f"iter {it + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["eval"].items())
                      + f"; best det_hmean {row['sweep'][best]:.1f} at score threshold {best}")
            extra = {"glyph_head": glyphs.head.state_dict()} if glyphs else {}
            if args.train != "all":
                extra["train"] = args.train
            save_checkpoint(last, model, optimizer, it + 1, **extra)
            save_weights_fp16(out / f"model_{it + 1:06d}_fp16.pth", model, it + 1)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if done:
            break
    log.close()
    if start < args.iters:
        print(json.dumps({"iterations": it + 1, "seconds_this_run": round(time.time() - began, 1),
                          "seconds_per_iteration": round((time.time() - began) / max(it + 1 - start, 1), 3),
                          "share_waiting_for_pictures": round(waited_total / max(time.time() - began, 1e-9), 3)}))
    if args.fixture and it + 1 >= args.iters:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        curve = [{k: r[k] for k in ("iter", "seconds", "lr", "total", "loss_ce", "loss_ctrl_points", "loss_texts",
                                     "eval", "sweep") if k in r} for r in rows if "eval" in r]
        publish(model, cfg, out / f"model_{args.iters:06d}_fp16.pth", Path(args.fixture), out / "data" / "final",
                args.final_seed, args.final_count, args.size, {
                    "config": str(Path(args.config).resolve().relative_to(REPO)), "overrides": args.overrides,
                    "iterations": args.iters, "seed": args.seed, "trained": args.train,
                    "train": {"count": args.train_count or "stream", "seed": 0, "size": args.size},
                    "validation": {"count": args.eval_count, "seed": args.eval_seed, "size": args.size},
                    "command": "python training/train_spotter.py "
                               + " ".join(argv if argv is not None else sys.argv[1:]),
                    "train_seconds": round(rows[-1]["seconds"]) if rows else 0, "curve": curve,
                    **({"init": lineage} if lineage else {})})
    return 0


def text_only(model) -> None:
    """Only the text branch learns: every parameter without "text" in its name (the backbone, the encoder, the
    proposals, the location branch and its heads) is frozen, and the BatchNorms among them stay in eval mode when
    the model trains, so no statistic moves either. The matcher still pairs words with queries by the location
    branch's outputs, which no longer change: each word is read by the query that detects it."""
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [m for name, m in model.named_modules() if isinstance(m, _BatchNorm) and "text" not in name]
    for name, p in model.named_parameters():
        p.requires_grad_("text" in name)

    def frozen_norms(module, args):
        for norm in norms:
            norm.eval()

    model.register_forward_pre_hook(frozen_norms)


if __name__ == "__main__":
    sys.exit(main())
