"""Train the segmenter fixture: the tiny Mask2Former of third_party/mask2former (configs/tiny/panoptic.yaml, thin
R-50) on `d2export synth boxes --segmentation` (5 shapes as things, bars and background as stuff: 7 classes), on
the CPU. The stand-in is inference only, so the training loss is written here: Hungarian matching on class, mask BCE
and dice costs at the mask logits' resolution (1/4 of the picture), then class cross-entropy (no-object weighted
0.1), mask BCE and dice on the matched queries, for the last prediction and each auxiliary one (upstream's weights:
MODEL.MASK_FORMER.CLASS/MASK/DICE_WEIGHT).

Seeded; resumable (run it again with the same --out: it goes on from last.pth, its time and curve kept); logs the
losses every --log-every steps; checkpoints every --checkpoint-minutes. It stops at --steps or, where given, after
--minutes of training (over every run of the same --out), whichever comes first; the learning rate drops tenfold
at --decay-at of the way (the further of steps and minutes). The backbone trains with BatchNorm (a 50-layer ResNet
does not learn from scratch without normalisation); the weights written are those of the config as d2export exports
it (FrozenBN: the same tensors, less `num_batches_tracked`).

At the end it scores the held-out set (another seed) with the model's own inference (its forward on list[dict]:
semantic, panoptic and instance outputs) through d2export's SegmentationEvaluator (mIoU, PQ, mask AP), run on the
float16 weights restored to float32 as they ship, and writes them with their record (command, machine, data, steps,
minutes, curve, held-out figures, sha256) to --fixture (default: OUT/segmenter_fixture.pth).

    python training/train_segmenter_fixture.py --out outputs/segmenter_fixture --minutes 40 \\
        --fixture tests/data/segmenter_fixture.pth
    python training/train_segmenter_fixture.py --out /tmp/segfix_smoke --steps 30 --train-count 64 \\
        --held-out-count 8  # a smoke run

Exporting the fixture (the class count, queries and thresholds differ from configs/mask2former_tiny.yaml's):
    python tools/export.py --config mask2former_tiny model.weights=tests/data/segmenter_fixture.pth \\
        'model.opts=[MODEL.SEM_SEG_HEAD.NUM_CLASSES,7,MODEL.MASK_FORMER.NUM_OBJECT_QUERIES,20,\\
        MODEL.MASK_FORMER.TEST.OBJECT_MASK_THRESHOLD,0.8]'
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party" / "mask2former")]
from training.common import machine  # noqa: E402

CONFIG = REPO / "third_party" / "mask2former" / "configs" / "tiny" / "panoptic.yaml"
# (dataset name, synth seed): seeds of this set's own (the box fixture draws boxes from 0 and 1, the spotter text)
TRAIN, HELD_OUT = ("synth_segments_train", 30), ("synth_segments_held_out", 31)


# ------------------------------------------------------------------------------------------------- the model
def model_cfg(size: tuple[int, int], queries: int, overrides=()):
    """The tiny panoptic Mask2Former for the synthetic set: its class count, `queries` queries, read at the pictures'
    own size, all three outputs on, upstream's object threshold (the tiny config's 0.0 is for random weights).
    This is the config the fixture is exported with; the datasets must be registered before a model is built."""
    from d2export.datasets.boxes import PANOPTIC_CATEGORIES
    from d2export.patching import compiled_ops

    # the MSDA op with a backward (d2export's pure-PyTorch core); detectron2's _C, imported by mask2former's
    # evaluator, never run
    compiled_ops.install(["MultiScaleDeformableAttention"], import_only=["detectron2._C"])
    import mask2former
    from detectron2.config import get_cfg
    from detectron2.projects.deeplab import add_deeplab_config

    cfg = get_cfg()
    add_deeplab_config(cfg)
    mask2former.add_maskformer2_config(cfg)
    cfg.merge_from_file(str(CONFIG))
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.SEM_SEG_HEAD.NUM_CLASSES = len(PANOPTIC_CATEGORIES)
    cfg.MODEL.MASK_FORMER.NUM_OBJECT_QUERIES = queries
    test = cfg.MODEL.MASK_FORMER.TEST
    test.SEMANTIC_ON = test.PANOPTIC_ON = test.INSTANCE_ON = True
    test.OBJECT_MASK_THRESHOLD = 0.8
    cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST = min(size), max(size)
    cfg.DATASETS.TRAIN, cfg.DATASETS.TEST = (TRAIN[0],), (HELD_OUT[0],)
    cfg.merge_from_list(list(overrides))
    return cfg


def export_opts(cfg) -> list:
    """What d2export's mask2former_tiny config needs in model.opts to build this model."""
    mf = cfg.MODEL.MASK_FORMER
    return ["MODEL.SEM_SEG_HEAD.NUM_CLASSES", cfg.MODEL.SEM_SEG_HEAD.NUM_CLASSES,
            "MODEL.MASK_FORMER.NUM_OBJECT_QUERIES", mf.NUM_OBJECT_QUERIES,
            "MODEL.MASK_FORMER.TEST.OBJECT_MASK_THRESHOLD", mf.TEST.OBJECT_MASK_THRESHOLD]


def shipped_state(model) -> dict:
    """The training model's tensors as the exported config's model holds them (BatchNorm's counters dropped), in
    float16, with the modules' versions (`_metadata`: without them MaskFormerHead takes the weights for its old
    layout and moves the pixel decoder's keys)."""
    from collections import OrderedDict

    full = model.state_dict()
    state = OrderedDict((k, v.half() if v.is_floating_point() else v) for k, v in full.items()
                        if not k.endswith("num_batches_tracked"))
    state._metadata = full._metadata
    return state


# -------------------------------------------------------------------------------------------------- the data
class Pictures:
    """A registered synthetic segmentation set held in memory: RGB pictures [N, H, W, 3] uint8, panoptic segment
    ids [N, H, W] and each picture's segments (contiguous class, id)."""

    def __init__(self, name: str):
        import cv2
        import numpy as np
        from detectron2.data import DatasetCatalog

        self.records = DatasetCatalog.get(name)
        images, ids, self.segments = [], [], []
        for r in self.records:
            images.append(cv2.imread(r["file_name"], cv2.IMREAD_COLOR)[..., ::-1])
            rgb = cv2.imread(r["pan_seg_file_name"], cv2.IMREAD_COLOR)[..., ::-1].astype(np.int64)
            pan = rgb[..., 0] + 256 * rgb[..., 1] + 65536 * rgb[..., 2]
            if pan.max() > 255:
                raise ValueError(f"{r['pan_seg_file_name']}: segment ids past 255")
            ids.append(pan.astype(np.uint8))
            self.segments.append([(int(s["category_id"]), int(s["id"])) for s in r["segments_info"]
                                  if not s.get("iscrowd")])
        self.images, self.ids = np.stack(images), np.stack(ids)

    def __len__(self):
        return len(self.records)

    def batch(self, rng, size: int):
        """`size` pictures drawn by `rng`, each flipped left-right at random: (images [B, 3, H, W] float, targets:
        per picture {"labels" [T], "masks" [T, H, W] float})."""
        import numpy as np
        import torch

        picked = rng.choice(len(self), size, replace=len(self) < size)
        flips = rng.random(size) < 0.5
        images, targets = [], []
        for i, flip in zip(picked, flips):
            img, pan = self.images[i], self.ids[i]
            if flip:
                img, pan = img[:, ::-1], pan[:, ::-1]
            images.append(torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float())
            pan = torch.from_numpy(np.ascontiguousarray(pan))
            cls = [c for c, _ in self.segments[i]]
            masks = torch.stack([pan == s for _, s in self.segments[i]]) if cls else torch.zeros(0, *pan.shape)
            targets.append({"labels": torch.as_tensor(cls, dtype=torch.long), "masks": masks.float()})
        return torch.stack(images), targets


# -------------------------------------------------------------------------------------------------- the loss
def pair_costs(logits, masks, labels, targets):
    """Hungarian costs [Q, T] of one picture: class (-probability of the target's class), mask BCE (mean over
    pixels) and dice, between the queries' mask logits [Q, P] and the targets' masks [T, P] (soft, in [0, 1])."""
    import torch.nn.functional as F

    cost_class = -logits.softmax(-1)[:, labels]
    pos, neg = F.softplus(-masks), F.softplus(masks)  # BCE against 1 and against 0, per pixel
    cost_bce = (pos @ targets.T + neg @ (1 - targets).T) / masks.shape[1]
    probs = masks.sigmoid()
    dice = (2 * probs @ targets.T + 1) / (probs.sum(-1)[:, None] + targets.sum(-1)[None] + 1)
    return cost_class, cost_bce, 1 - dice


def set_loss(pred_logits, pred_masks, targets, weights, no_object: float):
    """One prediction's losses over the batch: {"ce", "mask", "dice"}, unweighted; `targets` hold masks at the
    predictions' resolution."""
    import torch
    import torch.nn.functional as F
    from scipy.optimize import linear_sum_assignment

    b, q, k1 = pred_logits.shape
    classes = torch.full((b, q), k1 - 1, dtype=torch.long)
    matched_pred, matched_tgt = [], []
    with torch.no_grad():
        for i, t in enumerate(targets):
            if not len(t["labels"]):
                continue
            c_cls, c_bce, c_dice = pair_costs(pred_logits[i], pred_masks[i].flatten(1), t["labels"],
                                              t["masks"].flatten(1))
            cost = weights["class"] * c_cls + weights["mask"] * c_bce + weights["dice"] * c_dice
            rows, cols = linear_sum_assignment(cost.numpy())
            rows, cols = torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)
            classes[i, rows] = t["labels"][cols]
            matched_pred.append((i, rows))
            matched_tgt.append(t["masks"][cols])
    class_weight = torch.ones(k1)
    class_weight[-1] = no_object
    ce = F.cross_entropy(pred_logits.transpose(1, 2), classes, class_weight)
    if not matched_pred:
        zero = pred_masks.sum() * 0
        return {"ce": ce, "mask": zero, "dice": zero}
    pred = torch.cat([pred_masks[i, rows] for i, rows in matched_pred]).flatten(1)
    tgt = torch.cat(matched_tgt).flatten(1)
    n = max(len(tgt), 1)
    bce = F.binary_cross_entropy_with_logits(pred, tgt, reduction="none").mean(1).sum() / n
    probs = pred.sigmoid()
    dice = (1 - (2 * (probs * tgt).sum(1) + 1) / (probs.sum(1) + tgt.sum(1) + 1)).sum() / n
    return {"ce": ce, "mask": bce, "dice": dice}


def losses(outputs, targets, weights, no_object: float, deep: bool):
    """The weighted total and its unweighted parts (summed over the last prediction and, with `deep`, the
    auxiliary ones)."""
    import torch.nn.functional as F

    h, w = outputs["pred_masks"].shape[-2:]
    small = [{"labels": t["labels"], "masks": F.interpolate(t["masks"][None], size=(h, w), mode="area")[0]
              if len(t["labels"]) else t["masks"].new_zeros(0, h, w)} for t in targets]
    levels = [outputs] + (list(outputs.get("aux_outputs") or []) if deep else [])
    parts = {"ce": 0.0, "mask": 0.0, "dice": 0.0}
    for level in levels:
        for key, value in set_loss(level["pred_logits"], level["pred_masks"], small, weights, no_object).items():
            parts[key] = parts[key] + value
    total = weights["class"] * parts["ce"] + weights["mask"] * parts["mask"] + weights["dice"] * parts["dice"]
    return total, {k: float(v.detach()) for k, v in parts.items()}


def pad_targets(targets, hw):
    """Targets' masks padded (bottom, right) to the padded batch's size."""
    import torch.nn.functional as F

    return [{"labels": t["labels"], "masks": F.pad(t["masks"], (0, hw[1] - t["masks"].shape[-1],
                                                               0, hw[0] - t["masks"].shape[-2]))} for t in targets]


# ----------------------------------------------------------------------------------------------- the scoring
def score(model, name: str, size: tuple[int, int]):
    """The model's own inference on dataset `name` (resized as its test config says), scored by d2export's
    SegmentationEvaluator."""
    import cv2
    import torch
    from detectron2.data import DatasetCatalog
    from detectron2.data import transforms as T

    from d2export.evaluating.evaluators import SegmentationEvaluator

    resize = T.ResizeShortestEdge(min(size), max(size))
    evaluator = SegmentationEvaluator(name)
    evaluator.reset()
    model.eval()
    with torch.no_grad():
        for r in DatasetCatalog.get(name):
            img = cv2.imread(r["file_name"], cv2.IMREAD_COLOR)[..., ::-1]
            img = resize.get_transform(img).apply_image(img)
            image = torch.as_tensor(img.copy()).permute(2, 0, 1).float()
            inputs = [{**r, "image": image, "height": r["height"], "width": r["width"]}]
            evaluator.process(inputs, model(inputs))
    return evaluator.evaluate()


def headline(results) -> dict:
    """mIoU, PQ (things, stuff) and mask AP of the evaluator's results."""
    sem, pan, segm = results.get("sem_seg", {}), results.get("panoptic_seg", {}), results.get("segm", {})
    out = {"mIoU": sem.get("mIoU"), "PQ": pan.get("PQ"), "PQ_th": pan.get("PQ_th"), "PQ_st": pan.get("PQ_st"),
           "segm_AP": segm.get("AP"), "segm_AP50": segm.get("AP50")}
    return {k: round(float(v), 3) if v is not None else None for k, v in out.items()}


# --------------------------------------------------------------------------------------------------- the run
def lr_at(lr: float, step: int, progress: float, warmup: int, decay_at: float) -> float:
    return lr * min(1.0, (step + 1) / warmup) * (0.1 if progress >= decay_at else 1.0)


def param_groups(model, lr: float, weight_decay: float):
    """No weight decay for norms, biases and the decoder's embeddings (as upstream)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (plain if p.ndim < 2 or "embed.weight" in name or "query_feat" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/segmenter_fixture", help="checkpoints, log and the synthetic sets")
    ap.add_argument("--steps", type=int, default=20000, help="stop after this many steps")
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="stop after this many minutes of training, over every run of --out (0: no limit)")
    ap.add_argument("--train-count", type=int, default=3000, help="training pictures (seed %d)" % TRAIN[1])
    ap.add_argument("--held-out-count", type=int, default=200, help="held-out pictures (seed %d)" % HELD_OUT[1])
    ap.add_argument("--size", default="160x160", help="picture size (the model reads them at this size)")
    ap.add_argument("--batch", type=int, default=6, help="pictures a step")
    ap.add_argument("--queries", type=int, default=20, help="object queries (the tiny config's 10 is the most a "
                    "picture's segments can number)")
    ap.add_argument("--lr", type=float, default=2e-4, help="AdamW's learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.05, help="AdamW's weight decay")
    ap.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    ap.add_argument("--decay-at", type=float, default=0.85,
                    help="fraction of the run (of --steps or of --minutes, the further) after which the rate is a "
                         "tenth")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    ap.add_argument("--no-object", type=float, default=0.1, help="the no-object class's cross-entropy weight")
    ap.add_argument("--seed", type=int, default=0, help="training seed (weights, batches, flips)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--log-every", type=int, default=20, help="steps between loss lines")
    ap.add_argument("--checkpoint-minutes", type=float, default=3.0, help="minutes between checkpoints")
    ap.add_argument("--fixture", default="", help="where to write the float16 weights and their record "
                    "(default: OUT/segmenter_fixture.pth)")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs as detectron2 takes them")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from detectron2.modeling import build_model

    from d2export.datasets import generate, register
    from d2export.datasets.boxes import PANOPTIC_CATEGORIES
    from d2export.datasets.synth import parse_size

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.size)
    for (name, seed), count in ((TRAIN, args.train_count), (HELD_OUT, args.held_out_count)):
        folder = out / "data" / name
        if not (folder / "annotations.json").is_file():
            generate("boxes", folder, count=count, seed=seed, size=size, segmentation=True)
        register(name, folder)
        drawn = json.loads((folder / "annotations.json").read_text())["info"]
        if (drawn["count"], drawn["seed"], drawn["size"]) != (count, seed, f"{size[0]}x{size[1]}"):
            ap.error(f"{folder} holds {drawn['count']} pictures of seed {drawn['seed']} at {drawn['size']}: "
                     "use another --out or the same --train-count/--held-out-count/--size")

    cfg = model_cfg(size, args.queries, args.overrides)
    train_cfg = cfg.clone()
    train_cfg.MODEL.RESNETS.NORM = "BN"
    model = build_model(train_cfg)
    model.train()
    mf = cfg.MODEL.MASK_FORMER
    weights = {"class": mf.CLASS_WEIGHT, "mask": mf.MASK_WEIGHT, "dice": mf.DICE_WEIGHT}
    optimizer = torch.optim.AdamW(param_groups(model, args.lr, args.weight_decay), lr=args.lr)

    last = out / "last.pth"
    step, seconds, curve, commands = 0, 0.0, [], []
    if last.is_file():
        state = torch.load(last, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, seconds, curve, commands = state["step"], state["seconds"], state["curve"], state.get("commands", [])
        print(f"resumed from {last}: step {step}, {seconds / 60:.1f} minutes trained")

    command = "python training/train_segmenter_fixture.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commands.append(command)  # every run of this --out, resumed ones after the first

    def save():
        tmp = last.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "seconds": seconds, "curve": curve, "commands": commands, "args": vars(args)}, tmp)
        tmp.replace(last)

    def progress():
        return max(step / args.steps, seconds / (60 * args.minutes) if args.minutes else 0.0)

    data = Pictures(TRAIN[0])
    mean, std = model.pixel_mean, model.pixel_std
    divisible = model.size_divisibility
    window = {"loss": [], "ce": [], "mask": [], "dice": []}
    saved_at = time.time()
    while progress() < 1:
        started = time.time()
        rate = lr_at(args.lr, step, progress(), args.warmup, args.decay_at)
        for group in optimizer.param_groups:
            group["lr"] = rate
        images, targets = data.batch(np.random.default_rng([args.seed, step]), args.batch)
        images = (images - mean) / std
        h, w = images.shape[-2:]
        ph, pw = (-(-h // divisible) * divisible, -(-w // divisible) * divisible) if divisible else (h, w)
        images = torch.nn.functional.pad(images, (0, pw - w, 0, ph - h))
        outputs = model.sem_seg_head(model.backbone(images))
        total, parts = losses(outputs, pad_targets(targets, (ph, pw)), weights, args.no_object,
                              bool(mf.DEEP_SUPERVISION))
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        step += 1
        seconds += time.time() - started
        window["loss"].append(float(total.detach()))
        for k, v in parts.items():
            window[k].append(v)
        if step % args.log_every == 0 or progress() >= 1:
            point = {"step": step, "minutes": round(seconds / 60, 2), "lr": rate,
                     **{k: round(float(np.mean(v)), 4) for k, v in window.items()}}
            curve.append(point)
            window = {k: [] for k in window}
            print(json.dumps(point), flush=True)
        if time.time() - saved_at > 60 * args.checkpoint_minutes:
            save()
            saved_at = time.time()
    save()
    print(f"trained {step} steps in {seconds / 60:.1f} minutes ({step / max(seconds, 1e-9) * 60:.1f} steps/minute)")

    # what ships: float16, in the exported config's model (FrozenBN), restored to float32
    fixture = Path(args.fixture) if args.fixture else out / "segmenter_fixture.pth"
    fixture.parent.mkdir(parents=True, exist_ok=True)
    state = shipped_state(model)
    tmp = fixture.with_name(f".{fixture.name}.tmp")
    torch.save({"model": state, "__author__": "d2export training/train_segmenter_fixture.py"}, tmp)
    shipped = build_model(cfg)  # float16 values into the float32 model, from the file: what the fixture ships
    shipped.load_state_dict(torch.load(tmp, map_location="cpu", weights_only=False)["model"], strict=True)
    results = score(shipped, HELD_OUT[0], size)
    tmp.replace(fixture)
    record = {
        "config": str(CONFIG.relative_to(REPO)), "overrides": export_opts(cfg) + list(args.overrides),
        # configs/mask2former_fixture.yaml holds export_opts (and the synthetic sets' classes)
        "export": f"python tools/export.py --config mask2former_fixture model.weights={fixture}",
        "classes": [c["name"] for c in PANOPTIC_CATEGORIES],
        "steps": step, "minutes": round(seconds / 60, 1), "batch": args.batch, "lr": args.lr,
        "weight_decay": args.weight_decay, "decay_at": args.decay_at, "seed": args.seed, "precision": "float32",
        "train": {"count": args.train_count, "seed": TRAIN[1], "size": args.size},
        "held_out": {"count": args.held_out_count, "seed": HELD_OUT[1], "size": args.size,
                     "read_at": {"min_size": cfg.INPUT.MIN_SIZE_TEST, "max_size": cfg.INPUT.MAX_SIZE_TEST},
                     **headline(results), "results": results},
        "seeds_note": "synth boxes --segmentation seeds 30 (train) and 31 (held out): seeds of this fixture's own",
        "curve": curve, "machine": machine(),
        "command": command, "commands": commands,
        "sha256": hashlib.sha256(fixture.read_bytes()).hexdigest(), "bytes": fixture.stat().st_size}
    fixture.with_suffix(".json").write_text(json.dumps(record, indent=2, default=float) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("curve",)}, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
