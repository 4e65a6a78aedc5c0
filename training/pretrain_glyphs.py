"""Teach the spotter's backbone characters before it learns to spot (step 1 of the micro spotter's recipe,
docs/training.md): what ImageNet and SynthText pretraining give upstream TESTR, done on the synthetic stream in
minutes.

A linear classifier reads the stride-8 map (res3, the level the text queries sample finest) at each character's
centre — the exact centre where the renderer placed its glyph (`glyph_centres`), not an even share of the word —
and the stem, res2 and res3 train under it. Only those three stages run, so a step costs a fraction of a spotter
step and labels every character of its pictures. The result is the whole model's float16 weights with the new
backbone (everything else as --init had it), ready for `training/train_spotter.py --init`.

    python training/pretrain_glyphs.py --init tests/data/spotter_fixture.pth --out outputs/glyphs --minutes 25
    python training/pretrain_glyphs.py --device cuda --workers 12 --batch 32 --out outputs/glyphs_gpu --minutes 10

Every --eval-every steps the classifier is scored on --eval-count pictures of --eval-seed (validation: 2); the
curve (metrics.jsonl, and model.json beside the weights with the command, the machine and what --init was, which
`training/train_spotter.py --init` keeps in its own record) holds the loss and that accuracy; the run's last step is
scored and saved too. Run again with the same --out to go on from last.pth.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party")]
from training.common import decayed, init_lineage, machine, read_glyphs, spotter_cfg  # noqa: E402


class GlyphReader:
    """The backbone's stem, res2 and res3 and a linear classifier at character centres of a batch of mapped
    records."""

    def __init__(self, model, voc_size: int):
        import torch

        from d2export.charset import charset

        self.model = model
        self.resnet = model.testr.backbone[0].backbone
        self.voc_size = voc_size
        self.chars = charset(voc_size)
        channels = self.resnet.res3[-1].conv3.out_channels
        self.head = torch.nn.Linear(channels, voc_size).to(model.device)

    def parameters(self):
        stages = [self.resnet.stem, self.resnet.res2, self.resnet.res3, self.head]
        return [p for m in stages for p in m.parameters()]

    def logits(self, batch):
        """(logits [n, voc_size], labels [n]) over every character of the batch."""
        import torch
        import torch.nn.functional as F

        device = self.model.device
        images = [self.model.normalizer(r["image"].to(device).float()) for r in batch]
        h = max(i.shape[-2] for i in images)
        w = max(i.shape[-1] for i in images)
        h, w = -(-h // 32) * 32, -(-w // 32) * 32
        x = torch.stack([F.pad(i, (0, w - i.shape[-1], 0, h - i.shape[-2])) for i in images])
        r = self.resnet
        return read_glyphs(self.head, r.res3(r.res2(r.stem(x))), (w, h), batch, self.voc_size, self.chars)

    def accuracy(self, records, mapper) -> float:
        import torch

        self.resnet.eval()
        right = total = 0
        try:
            with torch.no_grad():
                for i in range(0, len(records), 8):
                    logits, labels = self.logits([mapper(r) for r in records[i:i + 8]])
                    right += int((logits.argmax(1) == labels).sum())
                    total += len(labels)
        finally:
            self.resnet.train()
        return 100.0 * right / max(total, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro_spotter.yaml"))
    ap.add_argument("--init", default="", help="the spotter weights whose backbone trains (default: seeded ones)")
    ap.add_argument("--out", default="outputs/glyphs")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=8, help="pictures a step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--decay-at", type=int, default=0,
                    help="from this step on the rate is a tenth of --lr (0: constant); a resumed run keeps to it")
    ap.add_argument("--size", default="320x320")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-count", type=int, default=100)
    ap.add_argument("--eval-seed", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, every core or $OMP_NUM_THREADS)")
    ap.add_argument("--workers", type=int, default=1, help="processes drawing the stream (12 of 16 cores by a GPU)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs")
    args = ap.parse_args(argv)

    import torch

    cfg = spotter_cfg(args.config, args.overrides, args.threads)
    from detectron2.modeling import build_model
    from testr.data import DatasetMapperWithBasis
    from testr.data.stream import stream
    from testr.train import _atomic_save, load_checkpoint, save_weights_fp16

    from d2export.building import UserError, resolve_device
    from d2export.datasets import generate, register
    from d2export.datasets.catalog import text_record
    from d2export.datasets.synth import parse_size
    from detectron2.data import DatasetCatalog

    try:
        cfg.MODEL.DEVICE = resolve_device(args.device, option="--device ")
    except UserError as e:
        ap.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg)
    if args.init:
        load_checkpoint(Path(args.init), model)
    reader = GlyphReader(model, int(cfg.MODEL.TRANSFORMER.VOC_SIZE))
    optimizer = torch.optim.AdamW(reader.parameters(), lr=args.lr, weight_decay=1e-4)
    step = 0
    if (out / "last.pth").is_file():
        state = torch.load(out / "last.pth", map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        reader.head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    size = parse_size(args.size)
    folder = out / f"validation_{args.eval_seed}_{args.eval_count}"
    if not (folder / "annotations.json").is_file():
        generate("text", folder, count=args.eval_count, seed=args.eval_seed, size=size)
    register("glyphs_validation", folder)
    validation = DatasetCatalog.get("glyphs_validation")
    test_mapper = DatasetMapperWithBasis(cfg, is_train=True)  # keeps the annotations ...
    test_mapper.augmentation = DatasetMapperWithBasis(cfg, is_train=False).augmentation  # ... at the test size
    batches = stream(partial(text_record, 0, size=size), DatasetMapperWithBasis(cfg, is_train=True), args.batch,
                     seed=0, start=step, workers=args.workers)
    record = {"made_by": "training/pretrain_glyphs.py", "command": " ".join(sys.argv), "machine": machine(),
              "train": {"seed": 0, "size": args.size, "batch": args.batch, "lr": args.lr, "decay_at": args.decay_at},
              "validation": {"seed": args.eval_seed, "count": args.eval_count},
              **({"init": init_lineage(Path(args.init))} if args.init else {})}
    started, losses = time.time(), []

    def checkpoint():
        row = {"step": step, "lr": optimizer.param_groups[0]["lr"], "loss": sum(losses) / max(len(losses), 1),
               "seconds": round(time.time() - started),
               "validation_char_accuracy": round(reader.accuracy(validation, test_mapper), 2)}
        losses.clear()
        print(json.dumps(row), flush=True)
        with open(out / "metrics.jsonl", "a") as metrics:
            metrics.write(json.dumps(row) + "\n")
        _atomic_save({"model": model.state_dict(), "head": reader.head.state_dict(),
                      "optimizer": optimizer.state_dict(), "step": step}, out / "last.pth")
        save_weights_fp16(out / "model.pth", model, step)
        curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        (out / "model.json").write_text(json.dumps({**record, "steps": step, "curve": curve}, indent=1))

    model.train()
    while step < args.steps and time.time() - started < args.minutes * 60:
        for group in optimizer.param_groups:  # the features settle once the rate drops (constant: it levels off)
            group["lr"] = decayed(args.lr, step, args.decay_at)
        logits, labels = reader.logits(next(batches))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % args.eval_every == 0:
            checkpoint()
    if losses:  # the steps since the last evaluation
        checkpoint()
    return 0


if __name__ == "__main__":
    sys.exit(main())
