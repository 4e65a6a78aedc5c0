"""Train the spotter's text branch alone on cached features: steps 3 and 5 of the micro spotter's recipe
(docs/training.md, `--references own --fixture`), and a probe of whether its decoder can learn to read at all
(`--references true`).

The backbone and the encoder run once over a fixed set of pictures (at the test size) and what the decoder samples
is kept (`--source memory`: the encoder's output; `projected`: its input, the projected maps); then only the decoder
and the character classifier train on it — a step costs a small part of a spotter step, so thousands of steps fit
in minutes. Every `--eval-every` steps the words of the training pictures and of validation pictures (seed 2) are
read and scored as the text evaluator scores matched words (character accuracy: 1 - edits / length; words read:
equal ignoring case).

`--references own` reads as the spotter does: at the model's own references (its encoder's top proposals), each word
by the query the training matcher gives it, every query present. Only the text branch learns (the location
branch's output is not used), so detection is left exactly as it was; `--eval-count` ends with the whole spotter
through the text evaluator on validation pictures and saves its weights; `--fixture` writes them with their record.
`--references true` puts each word's query at its true box instead: if the decoder reads well there, the spotter
lacks steps or its references are off; if not, its features are the limit.

    python training/probe_decoder.py --init outputs/spotter/fixture.pth --out outputs/decoder \
        --data outputs/decoder/data --count 20000 --cache outputs/decoder/cache.pt --references own --lr 1e-3 \
        --steps 16000 --decay-at 12800 --minutes 75 --threads 2 --fixture outputs/decoder/spotter_fixture.pth
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party")]
from training.common import cpu_spotter, decayed, evaluate, init_lineage, publish, reading  # noqa: E402


def cache(model, mapper, records, keep=("memory", "projected"), half: bool = True) -> dict:
    """What the decoder may sample for each of `records` (all one size), where it looks and what it should read:
    {the features of `keep` ("memory", "projected") [N, S, C] (float16 with `half`), "shapes", "starts", "ratios",
    "mask" (one picture's: the same for all), "boxes" [per picture: its words' (n, 4) cxcywh boxes relative to the
    picture], "texts" [(n, T) ids], "own" [(Q, 4): the model's own references, its encoder's top proposals],
    "matched" [(Q,): the word the training matcher gives each query, -1 for none]}. The features are written into
    tensors allocated once (at 320², 2,125 positions of 128 channels: 0.54 MB a picture in float16, 10,000 pictures
    5.4 GB; a list and its stacked copy were twice that)."""
    import torch

    from d2export.progress import steps

    decoder, encoder = model.testr.transformer.decoder, model.testr.transformer.encoder
    seen = {}

    def at_encoder(module, args):
        seen["projected"] = args[0]

    def at_decoder(module, args):  # (tgt, tgt_text, refs, memory, shapes, starts, ratios, pos, pos_text, mask, ...)
        seen.update(refs=args[2], memory=args[3], shapes=args[4], starts=args[5], ratios=args[6], mask=args[9])

    hooks = [encoder.register_forward_pre_hook(at_encoder), decoder.register_forward_pre_hook(at_decoder)]
    found = {k: [] for k in ("boxes", "texts", "own", "matched")}
    model.eval()
    try:
        with torch.no_grad():
            for i, record in enumerate(steps(records, "caching features")):
                item = mapper(record)
                outputs = model.testr(model.preprocess_image([item]))
                target = model.prepare_targets([item["instances"]])[0]
                # the queries the spotter's own training would teach to read each word
                (queries, words), = model.criterion.point_matcher({**outputs, "pred_references": seen["refs"]},
                                                                  [target])
                matched = torch.full((seen["refs"].shape[1],), -1, dtype=torch.long)
                matched[queries] = words
                for key in keep:
                    if key not in found:
                        found[key] = seen[key].new_empty((len(records), *seen[key].shape[1:]),
                                                         dtype=torch.float16 if half else seen[key].dtype)
                    if found[key].shape[1:] != seen[key].shape[1:]:
                        raise SystemExit("probe_decoder: the pictures must map to one size (use square pictures of "
                                         "one size)")
                    found[key][i] = seen[key][0]
                found["boxes"].append(target["boxes"])
                found["texts"].append(target["texts"].long())
                found["own"].append(seen["refs"][0])
                found["matched"].append(matched)
    finally:
        for hook in hooks:
            hook.remove()
    return {**found, **{k: seen[k] for k in ("shapes", "starts", "ratios", "mask")}}


SPARE_BOX = (0.5, 0.5, 0.1, 0.1)  # with true references, the reference of a query beyond its picture's words


def references(data: dict, i: int, which: str):
    """Picture i's query references (Q, 4) and the word each query reads (Q,), -1 for none: `which` "true": a query
    per word at its true box; "own": the model's own references, each word read by its matched query."""
    import torch

    if which == "own":
        return data["own"][i], data["matched"][i]
    n = len(data["boxes"][i])
    return data["boxes"][i], torch.arange(n)


def text_logits(model, data: dict, index: list[int], source: str, queries: int = 0, which: str = "true"):
    """Every decoder layer's character logits [L, B, Q, T, V + 1] for the pictures `index` of `data` at their
    references (`which`, see `references`), and the word each query reads [B, Q] (-1: none). Q: `queries`, or the
    most references a picture of `index` has (the character slots of one slot index attend to each other across
    queries: the spotter's own spare queries sit on its other proposals)."""
    import torch

    testr, transformer = model.testr, model.testr.transformer
    picked = [references(data, i, which) for i in index]
    q = queries or max(max(len(r) for r, _ in picked), 1)
    refs = torch.tensor(SPARE_BOX).repeat(len(index), q, 1)
    reads = torch.full((len(index), q), -1, dtype=torch.long)
    for b, (r, w) in enumerate(picked):
        refs[b, :len(r)], reads[b, :len(w)] = r, w
    memory = data[source][index].float()
    bsz = len(index)
    unact = torch.log(refs.clamp(1e-4, 1 - 1e-4) / (1 - refs.clamp(1e-4, 1 - 1e-4)))
    query_pos = transformer.pos_trans_norm(transformer.pos_trans(transformer.get_proposal_pos_embed(unact)))
    # the location branch runs on one control point: its output is not used, and the text branch never reads it
    query_embed = testr.ctrl_point_embed.weight[None, None, :1].expand(bsz, q, -1, -1)
    query_pos = query_pos[:, :, None]
    text_embed = testr.text_embed.weight[None, None].expand(bsz, q, -1, -1)
    text_pos = testr.text_pos_embed(testr.text_embed.weight)[None].expand(q, -1, -1)
    _, hs_text, _ = transformer.decoder(
        query_embed, text_embed, refs, memory, data["shapes"], data["starts"], data["ratios"].expand(bsz, -1, -1),
        query_pos, text_pos, data["mask"].expand(bsz, -1), None)
    assert hs_text.shape[-2] == testr.max_text_len
    return testr.text_class(hs_text), reads


def targets_of(data: dict, index: list[int], reads):
    """The transcriptions [n, T] the queries that read a word (`reads` >= 0, in batch then query order) should give."""
    import torch

    return torch.cat([data["texts"][i][reads[b][reads[b] >= 0]] for b, i in enumerate(index)])


def score(model, data: dict, source: str, post: dict, which: str = "true", batch: int = 16) -> dict:
    """Reads the words of `data` at their references (`which`): character accuracy and words read (as the text
    evaluator counts matched words), in percent."""
    import torch

    from d2export.charset import decode
    from d2export.evaluating.text_metrics import Counts, read_pair

    chars = list(post["charset"])
    ctc = post["text_decoding"] == "ctc"
    counts = Counts()
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data["boxes"]), batch):
            index = list(range(start, min(start + batch, len(data["boxes"]))))
            logits, reads = text_logits(model, data, index, source, which=which)
            ids = logits[-1].argmax(-1)
            for b, i in enumerate(index):
                for query in (reads[b] >= 0).nonzero()[:, 0].tolist():
                    counts += read_pair(decode(data["texts"][i][reads[b, query]].tolist(), chars),
                                        decode(ids[b, query].tolist(), chars, ctc=ctc))
    return {"char_accuracy": round(counts.summary()["char_accuracy"], 2),
            "words_read": round(100.0 * counts.read / max(counts.matched, 1), 2), "words": counts.matched}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="the spotter weights whose features are read")
    ap.add_argument("--out", required=True, help="log.jsonl and result.json go here")
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro_spotter.yaml"))
    ap.add_argument("--source", choices=["memory", "projected"], default="memory")
    ap.add_argument("--references", choices=["true", "own"], default="true",
                    help="each word's true box, or the model's own references (its encoder's top proposals), each word"
                         " read by the query its training matcher gives it — as the spotter reads")
    ap.add_argument("--data", default="outputs/probe/data", help="training pictures (seed 0, made if absent)")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--cache", default="", help="the features of both sets, kept here (read if there: probes that\
 share --init, --data and --count run side by side without computing them twice)")
    ap.add_argument("--validation", default="outputs/probe/data_validation_100", help="seed 2, made if absent")
    ap.add_argument("--validation-count", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="pictures a step")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--decay-at", type=int, default=0,
                    help="from this step on the rate is a tenth of --lr (0: constant); with --steps, the end is known")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--steps", type=int, default=0, help="or stop after this many steps (0: only --minutes)")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1, help="1: two probes side by side on 2 cores")
    ap.add_argument("--eval-count", type=int, default=0,
                    help="at the end, the whole spotter (its text branch as trained here) through the text evaluator on"
                         " this many pictures of --validation, and its weights saved (model.pth)")
    ap.add_argument("--fixture", default="", help="at the end, the float16 weights written here with their record (as"
                    " training/train_spotter.py --fixture writes it), scored on --final-count pictures of --final-seed")
    ap.add_argument("--final-seed", type=int, default=1, help="seed of the held-out pictures --fixture scores")
    ap.add_argument("--final-count", type=int, default=200, help="held-out pictures --fixture scores")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs")
    args = ap.parse_args(argv)

    import torch

    cfg, model = cpu_spotter(args.config, args.overrides, args.threads, args.init)
    from detectron2.data import DatasetCatalog
    from testr.data import DatasetMapperWithBasis

    from d2export.datasets import generate, register

    mapper = DatasetMapperWithBasis(cfg, is_train=True)  # keeps the annotations ...
    mapper.augmentation = DatasetMapperWithBasis(cfg, is_train=False).augmentation  # ... at the test size
    weights = Path(args.init).stat()  # weights retrained in place make a new cache
    key = {"format": 3, "source": args.source, "init": str(Path(args.init).resolve()), "weights": [weights.st_size, weights.st_mtime_ns],
           "data": str(Path(args.data).resolve()), "count": args.count, "overrides": args.overrides,
           "validation": [str(Path(args.validation).resolve()), args.validation_count]}
    counts = {"train": args.count, "validation": args.validation_count}
    for name, folder, seed in (("train", args.data, 0), ("validation", args.validation, 2)):
        if not (Path(folder) / "annotations.json").is_file():
            generate("text", Path(folder), count=counts[name], seed=seed, size=(320, 320))
        register(f"decoder_{name}", Path(folder))
    kept = torch.load(args.cache, mmap=True) if args.cache and Path(args.cache).is_file() else {}
    if kept.get("key") == key:
        sets = kept["sets"]
    else:
        sets = {}
        for name, count in counts.items():
            records = DatasetCatalog.get(f"decoder_{name}")[:count]
            started = time.time()
            sets[name] = cache(model, mapper, records, keep=(args.source,))
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
    train_view = {k: v[:100] if isinstance(v, list) else v for k, v in sets["train"].items()}

    def evaluation(step, loss):
        row = {"step": step, "seconds": round(time.time() - started), "lr": optimizer.param_groups[0]["lr"],
               "loss_texts": loss,
               "train": score(model, train_view, args.source, post, args.references),
               "validation": score(model, sets["validation"], args.source, post, args.references)}
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()
        return row

    step, losses, started = 0, [], time.time()
    with open(out / "log.jsonl", "w") as log:
        rows = [evaluation(0, None)]
        while time.time() - started < args.minutes * 60 and not (args.steps and step >= args.steps):
            for group in optimizer.param_groups:
                group["lr"] = decayed(args.lr, step, args.decay_at)
            index = torch.randint(n, (args.batch,), generator=generator).tolist()
            model.train()
            logits, reads = text_logits(model, sets["train"], index, args.source, which=args.references)
            targets = targets_of(sets["train"], index, reads)
            loss = sum(criterion.text_loss(layer[reads >= 0], targets) for layer in logits)
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
    result = {"init": args.init, "source": args.source, "references": args.references, "lr": args.lr,
              "decay_at": args.decay_at,
              "batch": args.batch, "steps": step, "overrides": args.overrides, "first": rows[0], "last": rows[-1]}
    if args.eval_count:  # the whole spotter: its detections, and what their queries read
        from testr.train import save_checkpoint

        save_checkpoint(out / "model.pth", model, iteration=step)
        result["spotter"], result["sweep"] = evaluate(
            model, DatasetCatalog.get("decoder_validation")[:args.eval_count],
            DatasetMapperWithBasis(cfg, is_train=False), "decoder_validation", post)
        print(json.dumps(result["spotter"]), flush=True)
    (out / "result.json").write_text(json.dumps(result) + "\n")
    if args.fixture and args.steps and step < args.steps:  # cut short by --minutes: not the run its command says
        print(f"--minutes ran out at step {step} of --steps {args.steps} (before or without its --decay-at): no "
              f"fixture written; run again with more --minutes", file=sys.stderr)
        return 1
    if args.fixture:  # detection is --init's, reading is this run's: the last stage of the recipe
        from testr.train import save_weights_fp16

        snapshot = out / "model_fp16.pth"
        save_weights_fp16(snapshot, model, step)
        publish(model, cfg, snapshot, Path(args.fixture), out / "final", args.final_seed, args.final_count,
                "320x320", {
                    "config": str(Path(args.config).resolve().relative_to(REPO)), "overrides": args.overrides,
                    "iterations": step, "trained": f"text branch on cached features ({args.source}, "
                                                   f"{args.references} references)",
                    "train": {"count": args.count, "seed": 0, "size": "320x320", "batch": args.batch, "lr": args.lr,
                              "decay_at": args.decay_at},
                    "validation": {"count": counts["validation"], "seed": 2, "size": "320x320"},
                    "command": "python training/probe_decoder.py "
                               + " ".join(argv if argv is not None else sys.argv[1:]),
                    "train_seconds": rows[-1]["seconds"], "curve": rows, "init": init_lineage(Path(args.init))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
