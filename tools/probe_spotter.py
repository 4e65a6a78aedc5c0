"""Short probes of the TESTR stand-in's training (third_party/testr): the mean losses every 50 steps and, at the end,
where the matched queries' reference boxes lie (the boxes their text branch samples around): the fraction of words
whose matched query's reference centre lies inside the word's box, and their mean IoU.

`--true-refs` hands the decoder the words' true boxes as references (the first n queries of a picture with n words):
the character loss then shows whether recognition learns when every text query sees its word.

    python tools/probe_spotter.py --out outputs/probe/ref50 --minutes 10 MODEL.TRANSFORMER.NUM_QUERIES 16 \\
        MODEL.TRANSFORMER.LOSS.POINT_REF_WEIGHT 50.0
    python tools/probe_spotter.py --out outputs/probe/true --minutes 10 --true-refs
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party"), str(REPO / "tools")]


def with_true_references(model) -> dict:
    """In training, the decoder's reference boxes of a picture's first n queries become its n words' boxes (those
    `truth["boxes"]` holds: the batch's, set by the model's forward). Returns `truth`."""
    truth = {}
    forward = model.forward

    def remember(batched_inputs):
        if model.training:
            targets = model.prepare_targets([x["instances"] for x in batched_inputs])
            truth["boxes"] = [t["boxes"] for t in targets]
        return forward(batched_inputs)

    def replace(decoder, args):  # DeformableCompositeTransformerDecoder(tgt, tgt_text, reference_points, ...)
        if not model.training:
            return None
        refs = args[2].clone()
        for b, boxes in enumerate(truth["boxes"]):
            n = min(len(boxes), refs.shape[1])
            refs[b, :n] = boxes[:n].to(refs.dtype)
        return (args[0], args[1], refs, *args[3:])

    model.forward = remember
    model.testr.transformer.decoder.register_forward_pre_hook(replace)
    return truth


def reference_placement(model, mapper, records, truth: dict | None = None) -> dict:
    """Over `records`: where the matched queries' reference boxes lie relative to their words (`truth`: what
    `with_true_references` returned, if it was applied)."""
    import torch
    from torchvision.ops import box_convert, box_iou

    inside = total = 0
    ious = []
    model.train()  # the matching is training's
    with torch.no_grad():
        for i in range(0, len(records) - 1, 2):
            batch = [mapper(r) for r in records[i:i + 2]]
            targets = model.prepare_targets([x["instances"] for x in batch])
            if truth is not None:
                truth["boxes"] = [t["boxes"] for t in targets]
            outputs = model.testr(model.preprocess_image(batch))
            for b, (q, t) in enumerate(model.criterion.point_matcher(outputs, targets)):
                ref, word = outputs["pred_references"][b, q], targets[b]["boxes"][t]
                corners = box_convert(word, "cxcywh", "xyxy")
                inside += int(((ref[:, :2] >= corners[:, :2]) & (ref[:, :2] <= corners[:, 2:])).all(1).sum())
                total += len(q)
                ious += box_iou(box_convert(ref, "cxcywh", "xyxy"), corners).diagonal().tolist()
    return {"reference_centre_in_word": inside / max(total, 1), "reference_iou_mean": sum(ious) / max(len(ious), 1)}


def slot_placement(model, images) -> dict:
    """Where each character slot's text queries look, in the last decoder layer: the attention-weighted mean of
    their sampling points' x offset from their proposal's box centre, in box widths (averaged over heads, queries
    and `images`, a list of mapped test records), and how far apart one query's slots look (the mean over queries
    of the slots' standard deviation). Slots that read look where their characters are: slot 0 left, the last
    right."""
    import torch

    layer = model.testr.transformer.decoder.layers[-1]
    attn, seen = layer.attn_cross_text, {}
    hooks = [attn.sampling_offsets.register_forward_hook(lambda m, i, o: seen.__setitem__("offsets", o)),
             attn.attention_weights.register_forward_hook(lambda m, i, o: seen.__setitem__("weights", o)),
             layer.register_forward_pre_hook(lambda m, args: seen.__setitem__("refs", args[4]))]
    h, lv, p, slots = attn.n_heads, attn.n_levels, attn.n_points, model.testr.max_text_len
    centres = []
    model.eval()
    try:
        with torch.no_grad():
            for image in images:
                model([image])
                offsets = seen["offsets"].view(-1, slots, h, lv, p, 2)[..., 0]
                weights = seen["weights"].view(-1, slots, h, lv * p).softmax(-1).view(-1, slots, h, lv, p)
                box = seen["refs"][0]  # (Q, L, 4): the proposal's box per level, as the layer gets it
                share = box[:, None].expand(-1, slots, -1, -1)  # (Q, S, L, 4): what each slot samples around
                if getattr(layer, "slot_references", False):
                    from testr.layers.deformable_transformer import slot_boxes

                    share = slot_boxes(share)
                share, box = share[:, :, None, :, None], box[:, None, None, :, None]  # against (Q, S, h, L, p)
                x = share[..., 0] + offsets / p * share[..., 2] * 0.5  # where each point samples
                x = (x - box[..., 0]) / box[..., 2]  # from the box's centre, in box widths
                centres.append((x * weights).sum((-1, -2)).mean(-1))  # (Q, S)
    finally:
        for hook in hooks:
            hook.remove()
    c = torch.cat(centres)
    return {"slot_x": [round(float(v), 3) for v in c.mean(0)], "slot_spread": round(float(c.std(-1).mean()), 4)}


def text_reads_the_finest_level(model, bias: float = -10.0) -> None:
    """Makes every text query's cross attention put its weight on the finest level (stride 8, the only one fine
    enough for characters 11 px apart): `bias` added to its attention logits of the other levels (they still train).
    Measured on trained weights, two of the four heads of the text branch's last layer put 83-88% of their weight on
    stride 16, where the characters are not told apart."""
    import torch

    with torch.no_grad():
        for layer in model.testr.transformer.decoder.layers:
            attn = layer.attn_cross_text
            b = attn.attention_weights.bias.view(attn.n_heads, attn.n_levels, attn.n_points)
            b[:, 1:] += bias


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="log.jsonl, result.json and the weights (model.pth) go here")
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro.yaml"))
    ap.add_argument("--data", default="outputs/probe/data", help="the training pictures (made if absent)")
    ap.add_argument("--count", type=int, default=1000, help="training pictures")
    ap.add_argument("--size", default="320x320")
    ap.add_argument("--minutes", type=float, default=10, help="stop after this many minutes")
    ap.add_argument("--steps", type=int, default=0, help="or stop after this many steps (0: only --minutes)")
    ap.add_argument("--threads", type=int, default=1, help="1: two probes side by side on 2 cores")
    ap.add_argument("--init", default="", help="start from these weights (a checkpoint or the float16 fixture)")
    ap.add_argument("--true-refs", action="store_true", help="the words' true boxes as the decoder's references")
    ap.add_argument("--text-finest", action="store_true",
                    help="the text queries start attending the finest level only (text_reads_the_finest_level)")
    ap.add_argument("--glyph-weight", type=float, default=0.0,
                    help="a linear classifier reads each glyph while the spotter trains (pretrain_glyphs.GlyphLoss)")
    ap.add_argument("--glyph-where", choices=["memory", "projected"], default="memory")
    ap.add_argument("--eval-count", type=int, default=0,
                    help="at the end, the text evaluator on this many validation pictures (seed 2; 0: none)")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs")
    args = ap.parse_args(argv)

    import numpy as np
    from train_spotter import batches, spotter_cfg

    cfg = spotter_cfg(args.config, args.overrides, args.threads)
    cfg.MODEL.DEVICE = "cpu"
    random.seed(0)
    np.random.seed(0)  # detectron2's augmentations (the training sizes) draw from numpy's global generator
    from detectron2.data import DatasetCatalog
    from detectron2.modeling import build_model
    from detectron2.solver import build_lr_scheduler
    from testr.data import DatasetMapperWithBasis
    from testr.train import build_optimizer, load_checkpoint, train_step

    from d2export.datasets import generate, register
    from d2export.datasets.synth import parse_size

    data = Path(args.data)
    if not (data / "annotations.json").is_file():
        generate("text", data, count=args.count, seed=0, size=parse_size(args.size))
    register("probe_train", data)
    records = DatasetCatalog.get("probe_train")
    model = build_model(cfg)
    if args.init:
        load_checkpoint(Path(args.init), model)
    if args.text_finest:
        text_reads_the_finest_level(model)
    optimizer, mapper = build_optimizer(cfg, model), DatasetMapperWithBasis(cfg, is_train=True)
    if args.glyph_weight:
        from pretrain_glyphs import GlyphLoss

        GlyphLoss(model, args.glyph_weight, args.glyph_where).join(optimizer, cfg)
    scheduler = build_lr_scheduler(cfg, optimizer)
    truth = with_true_references(model) if args.true_refs else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clip = cfg.SOLVER.CLIP_GRADIENTS.CLIP_VALUE if cfg.SOLVER.CLIP_GRADIENTS.ENABLED else 0
    stream, started, sums, step = batches(records, mapper, cfg.SOLVER.IMS_PER_BATCH, 0, 0), time.time(), {}, 0
    with open(out / "log.jsonl", "w") as log:
        while time.time() - started < args.minutes * 60 and not (args.steps and step >= args.steps):
            losses = train_step(model, optimizer, next(stream), clip)
            scheduler.step()
            step += 1
            for k in ("total", "loss_texts", "loss_ctrl_points", "loss_ce", "loss_char_centres", "loss_glyphs"):
                if k in losses:
                    sums[k] = sums.get(k, 0.0) + losses[k]
            if step % 50 == 0:
                row = {"iter": step, "seconds": round(time.time() - started), **{k: round(v / 50, 3)
                                                                                  for k, v in sums.items()}}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(row, flush=True)
                sums = {}
    from testr.train import save_checkpoint

    save_checkpoint(out / "model.pth", model, iteration=step)  # a probe that decides may seed the long run
    result = {"steps": step, **reference_placement(model, mapper, records[:60], truth),
              **slot_placement(model, [DatasetMapperWithBasis(cfg, is_train=False)(r) for r in records[:12]])}
    if args.eval_count:  # what the probe's weights read on pictures it never trained on
        from train_spotter import evaluate, reading

        folder = Path(f"{args.data}_validation_{args.eval_count}")
        if not (folder / "annotations.json").is_file():
            generate("text", folder, count=args.eval_count, seed=2, size=parse_size(args.size))
        register("probe_validation", folder)
        result["validation"], result["sweep"] = evaluate(model, DatasetCatalog.get("probe_validation"),
                                                         DatasetMapperWithBasis(cfg, is_train=False),
                                                         "probe_validation", reading(cfg))
    (out / "result.json").write_text(json.dumps(result) + "\n")
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
