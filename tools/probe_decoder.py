"""Can the spotter's text decoder learn to read from its features, given the steps a CPU cannot give end to end?

The backbone and the encoder run once over a fixed set of pictures (at the test size) and what the decoder samples
is kept (`--source memory`: the encoder's output; `projected`: its input, the projected maps); then only the decoder
and the character classifier train on it, with each word's true box as its query's reference — a step costs a small
part of a spotter step, so thousands of steps fit in minutes. Every `--eval-every` steps the words of the training
pictures and of validation pictures (seed 2) are read and scored as the text evaluator scores matched words
(character accuracy: 1 - edits / length; words read: equal ignoring case).

If the decoder reads well here, the end-to-end spotter lacks steps (a GPU gives them); if it stays near what a linear
classifier at the glyphs' centres reads (`probe_features.py`), the features are the limit; if below, where the
character slots look is.

    python tools/probe_decoder.py --init outputs/probe57/W_glyph_loss/model.pth --out outputs/decoder/memory \\
        --minutes 30 MODEL.TRANSFORMER.TEXT_SLOT_REFERENCES True
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party"), str(REPO / "tools")]


class _Captured(Exception):
    """Stops the model's forward once the decoder's inputs are seen (the decoder and the heads need not run)."""


def cache(model, mapper, records, half: bool = True) -> dict:
    """What the decoder may sample for each of `records` (all one size) and their words: {"memory" and "projected"
    [N, S, C] (float16 with `half`), "shapes", "starts", "ratios", "mask" (one picture's: they are the same for all), "boxes" [list
    of (n, 4) cxcywh relative to the picture], "texts" [list of (n, T) ids]}."""
    import torch

    decoder, encoder = model.testr.transformer.decoder, model.testr.transformer.encoder
    seen = {}

    def at_encoder(module, args):
        seen["projected"] = args[0]

    def at_decoder(module, args):  # (tgt, tgt_text, refs, memory, shapes, starts, ratios, pos, pos_text, mask, ...)
        seen.update(memory=args[3], shapes=args[4], starts=args[5], ratios=args[6], mask=args[9])
        raise _Captured

    hooks = [encoder.register_forward_pre_hook(at_encoder), decoder.register_forward_pre_hook(at_decoder)]
    memory, projected, boxes, texts = [], [], [], []
    model.eval()
    try:
        with torch.no_grad():
            for record in records:
                item = mapper(record)
                try:
                    model.testr(model.preprocess_image([item]))
                except _Captured:
                    pass
                memory.append(seen["memory"][0].half() if half else seen["memory"][0])
                projected.append(seen["projected"][0].half() if half else seen["projected"][0])
                target = model.prepare_targets([item["instances"]])[0]
                boxes.append(target["boxes"])
                texts.append(target["texts"].long())
    finally:
        for hook in hooks:
            hook.remove()
    if len({f.shape for f in memory}) != 1:
        raise SystemExit("probe_decoder: the pictures must map to one size (use square pictures of one size)")
    return {"memory": torch.stack(memory), "projected": torch.stack(projected), "shapes": seen["shapes"], "starts": seen["starts"],
            "ratios": seen["ratios"], "mask": seen["mask"], "boxes": boxes, "texts": texts}


SPARE_BOX = (0.5, 0.5, 0.1, 0.1)  # the reference of a query beyond its picture's words


def text_logits(model, data: dict, index: list[int], source: str, queries: int = 0):
    """Every decoder layer's character logits [L, B, Q, T, V + 1] for the pictures `index` of `data`, each word's
    query referenced at its true box; and which queries hold a word [B, Q]. Q: `queries`, or as many as the most
    words a picture of `index` has (the character slots of one slot index attend to each other across queries: the
    spotter's own spare queries sit on its other proposals)."""
    import torch

    testr, transformer = model.testr, model.testr.transformer
    q = queries or max(max(len(data["boxes"][i]) for i in index), 1)
    refs = torch.tensor(SPARE_BOX).repeat(len(index), q, 1)
    held = torch.zeros(len(index), q, dtype=torch.bool)
    for b, i in enumerate(index):
        n = len(data["boxes"][i])
        refs[b, :n], held[b, :n] = data["boxes"][i], True
    memory = data[source][index].float()
    bsz = len(index)
    unact = torch.log(refs.clamp(1e-4, 1 - 1e-4) / (1 - refs.clamp(1e-4, 1 - 1e-4)))
    query_pos = transformer.pos_trans_norm(transformer.pos_trans(transformer.get_proposal_pos_embed(unact)))
    n_ctrl, n_chars = testr.num_ctrl_points, testr.max_text_len
    query_embed = testr.ctrl_point_embed.weight[None, None].expand(bsz, q, -1, -1)
    query_pos = query_pos[:, :, None].expand(-1, -1, n_ctrl, -1)
    text_embed = testr.text_embed.weight[None, None].expand(bsz, q, -1, -1)
    text_pos = testr.text_pos_embed(testr.text_embed.weight)[None].expand(q, -1, -1)
    _, hs_text, _ = transformer.decoder(
        query_embed, text_embed, refs, memory, data["shapes"], data["starts"], data["ratios"].expand(bsz, -1, -1),
        query_pos, text_pos, data["mask"].expand(bsz, -1), None)
    assert hs_text.shape[-2] == n_chars
    return testr.text_class(hs_text), held


def score(model, data: dict, source: str, post: dict, batch: int = 16) -> dict:
    """Reads every word of `data` at its true box: character accuracy and words read (as the text evaluator counts
    matched words), in percent."""
    import torch

    from d2export.charset import decode
    from d2export.evaluating.text_metrics import edits

    chars = list(post["charset"])
    ctc = post["text_decoding"] == "ctc"
    total = errors = words = right = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data["boxes"]), batch):
            index = list(range(start, min(start + batch, len(data["boxes"]))))
            logits, held = text_logits(model, data, index, source)
            ids = logits[-1].argmax(-1)
            for b, i in enumerate(index):
                for w, truth_ids in enumerate(data["texts"][i].tolist()):
                    truth = decode(truth_ids, chars)
                    read = decode(ids[b, w].tolist(), chars, ctc=ctc)
                    total += len(truth)
                    errors += min(edits(read.lower(), truth.lower()), len(truth))
                    words += 1
                    right += read.lower() == truth.lower()
    return {"char_accuracy": round(100.0 * (total - errors) / max(total, 1), 2),
            "words_read": round(100.0 * right / max(words, 1), 2), "words": words}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="the spotter weights whose features are read")
    ap.add_argument("--out", required=True, help="log.jsonl and result.json go here")
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro_spotter.yaml"))
    ap.add_argument("--source", choices=["memory", "projected"], default="memory")
    ap.add_argument("--data", default="outputs/probe/data", help="training pictures (seed 0, made if absent)")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--cache", default="", help="the features of both sets, kept here (read if there: probes that\
 share --init, --data and --count run side by side without computing them twice)")
    ap.add_argument("--validation", default="outputs/probe/data_validation_100", help="seed 2, made if absent")
    ap.add_argument("--batch", type=int, default=8, help="pictures a step")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--steps", type=int, default=0, help="or stop after this many steps (0: only --minutes)")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1, help="1: two probes side by side on 2 cores")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs")
    args = ap.parse_args(argv)

    import torch
    from train_spotter import reading, spotter_cfg

    cfg = spotter_cfg(args.config, args.overrides, args.threads)
    cfg.MODEL.DEVICE = "cpu"
    from detectron2.data import DatasetCatalog
    from detectron2.modeling import build_model
    from testr.data import DatasetMapperWithBasis
    from testr.train import load_checkpoint

    from d2export.datasets import generate, register

    model = build_model(cfg)
    load_checkpoint(Path(args.init), model)
    mapper = DatasetMapperWithBasis(cfg, is_train=True)  # keeps the annotations ...
    mapper.augmentation = DatasetMapperWithBasis(cfg, is_train=False).augmentation  # ... at the test size
    key = {"init": str(Path(args.init).resolve()), "data": str(Path(args.data).resolve()), "count": args.count,
           "overrides": args.overrides}
    if args.cache and Path(args.cache).is_file() and torch.load(args.cache, mmap=True)["key"] == key:
        sets = torch.load(args.cache, mmap=True)["sets"]
    else:
        sets = {}
        for name, folder, seed, count in (("train", args.data, 0, args.count),
                                          ("validation", args.validation, 2, 100)):
            if not (Path(folder) / "annotations.json").is_file():
                generate("text", Path(folder), count=count, seed=seed, size=(320, 320))
            register(f"decoder_{name}", Path(folder))
            records = DatasetCatalog.get(f"decoder_{name}")[:count]
            started = time.time()
            sets[name] = cache(model, mapper, records)
            print(f"{name}: {len(records)} pictures cached in {time.time() - started:.0f} s", flush=True)
        if args.cache:
            from testr.train import _atomic_save

            _atomic_save({"key": key, "sets": sets}, Path(args.cache))

    decoder_params = [p for n, p in model.named_parameters()
                      if n.startswith(("testr.transformer.decoder.", "testr.text_class.", "testr.text_embed."))]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in decoder_params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(decoder_params, lr=args.lr, weight_decay=cfg.SOLVER.WEIGHT_DECAY)
    post, criterion = reading(cfg), model.criterion
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n, generator = len(sets["train"]["boxes"]), torch.Generator().manual_seed(0)
    train_view = {**sets["train"], "boxes": sets["train"]["boxes"][:100], "texts": sets["train"]["texts"][:100]}

    def evaluation(step, loss):
        row = {"step": step, "seconds": round(time.time() - started), "loss_texts": loss,
               "train": score(model, train_view, args.source, post),
               "validation": score(model, sets["validation"], args.source, post)}
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()
        return row

    step, losses, started = 0, [], time.time()
    with open(out / "log.jsonl", "w") as log:
        rows = [evaluation(0, None)]
        while time.time() - started < args.minutes * 60 and not (args.steps and step >= args.steps):
            index = torch.randint(n, (args.batch,), generator=generator).tolist()
            model.train()
            logits, held = text_logits(model, sets["train"], index, args.source)
            targets = torch.cat([sets["train"]["texts"][i] for i in index])
            loss = sum(criterion.text_loss(layer[held], targets) for layer in logits)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(decoder_params, 1.0)
            optimizer.step()
            losses.append(float(loss.detach()) / len(logits))
            step += 1
            if step % args.eval_every == 0:
                rows.append(evaluation(step, round(sum(losses) / len(losses), 3)))
                losses.clear()
        if losses:
            rows.append(evaluation(step, round(sum(losses) / len(losses), 3)))
    result = {"init": args.init, "source": args.source, "lr": args.lr, "batch": args.batch, "steps": step,
              "overrides": args.overrides, "first": rows[0], "last": rows[-1]}
    (out / "result.json").write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
