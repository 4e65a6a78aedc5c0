"""Train the box fixture: a small Cascade R-CNN (configs/detectron2/box_fixture.yaml) on `d2export synth boxes`, with
detectron2's own trainer, on the CPU. Seeded; resumable (run it again: it goes on from its last checkpoint);
detectron2's trainer logs the losses every 20 iterations. At the end it scores the held-out set with COCOEvaluator
and writes the fixture: float16 weights (detectron2's checkpointer restores float32 on load) and their record.

    python training/train_box_fixture.py --out outputs/box_fixture --iters 6000 --bf16  # 44 minutes on 2 AMX Xeon cores
    python training/train_box_fixture.py --out outputs/box_fixture --iters 40  # a smoke run
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "detectron2" / "box_fixture.yaml"
FIXTURE = REPO / "tests" / "data" / "box_fixture.pth"
TRAIN, HELD_OUT = ("synth_boxes_train", 0), ("synth_boxes_held_out", 1)  # (dataset name, synth seed)


def config(out: Path, iters: int, seed: int, lr: float, decay_at=(0.8, 0.95), overrides=()):
    from detectron2.config import get_cfg

    cfg = get_cfg()
    cfg.merge_from_file(str(CONFIG))
    cfg.MODEL.DEVICE = "cpu"
    cfg.DATASETS.TRAIN, cfg.DATASETS.TEST = (TRAIN[0],), (HELD_OUT[0],)
    cfg.DATALOADER.NUM_WORKERS = 0  # both cores train; the pictures are small
    cfg.SOLVER.IMS_PER_BATCH = 4
    cfg.SOLVER.BASE_LR = lr
    cfg.SOLVER.MAX_ITER = iters
    cfg.SOLVER.WARMUP_ITERS = min(200, iters // 4)
    cfg.SOLVER.STEPS = tuple(sorted({int(iters * f) for f in decay_at} - {0}))  # distinct, as fvcore wants
    cfg.SOLVER.CHECKPOINT_PERIOD = 100
    cfg.TEST.EVAL_PERIOD = 0
    cfg.SEED = seed
    cfg.OUTPUT_DIR = str(out)
    cfg.merge_from_list(list(overrides))
    return cfg


def _cpu_has_bf16() -> bool:
    from d2export.cpu import cpu_features

    return bool({"amx_bf16", "avx512_bf16"} & set(cpu_features()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/box_fixture", help="checkpoints, logs and the synthetic sets")
    ap.add_argument("--iters", type=int, default=6000, help="training iterations (batches of 4 pictures)")
    ap.add_argument("--train-count", type=int, default=3000, help="training pictures")
    ap.add_argument("--held-out-count", type=int, default=300, help="held-out pictures (another seed)")
    ap.add_argument("--size", default="320x320", help="picture size")
    ap.add_argument("--seed", type=int, default=0, help="training seed")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate")
    ap.add_argument("--decay-at", default="0.8,0.95",
                    help="where the learning rate drops tenfold, as fractions of --iters (comma-separated)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, every core or $OMP_NUM_THREADS)")
    ap.add_argument("--bf16", action="store_true",
                    help="train under bfloat16 autocast (weights stay float32): 1.25x the steps on a CPU with AMX or "
                         "AVX-512 BF16, slower on one without")
    ap.add_argument("--fixture", default=str(FIXTURE), help="where to write the float16 weights ('' to skip)")
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs as detectron2 takes them")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from detectron2.engine import DefaultTrainer
    from detectron2.evaluation import COCOEvaluator, inference_on_dataset
    from detectron2.utils.logger import setup_logger

    from d2export.datasets import generate, register
    from d2export.datasets.synth import parse_size

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup_logger(str(out / "log.txt"))
    logging.getLogger("detectron2").setLevel(logging.INFO)
    size = parse_size(args.size)
    for (name, seed), count in ((TRAIN, args.train_count), (HELD_OUT, args.held_out_count)):
        folder = out / "data" / name
        if not (folder / "annotations.json").is_file():
            generate("boxes", folder, count=count, seed=seed, size=size)
        register(name, folder)

    if args.bf16 and not _cpu_has_bf16():
        print("warning: --bf16 on a CPU without native bfloat16 (AMX or AVX-512 BF16) is slower, not faster",
              file=sys.stderr)

    class Trainer(DefaultTrainer):
        def run_step(self):  # convolutions and matmuls in bfloat16; weights and the optimizer's state stay float32
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                super().run_step()

        @classmethod
        def build_optimizer(cls, cfg, model):  # from scratch, AdamW converges far sooner than SGD
            from detectron2.solver.build import get_default_optimizer_params

            params = get_default_optimizer_params(model, base_lr=cfg.SOLVER.BASE_LR,
                                                  weight_decay_norm=0.0)
            return torch.optim.AdamW(params, lr=cfg.SOLVER.BASE_LR, weight_decay=cfg.SOLVER.WEIGHT_DECAY)

        def build_hooks(self):  # the held-out score comes once, below, not also from the trainer's last hook
            from detectron2.engine.hooks import EvalHook

            return [h for h in super().build_hooks() if not isinstance(h, EvalHook)]

        def build_writers(self):  # the console and metrics.json; no TensorBoard
            from detectron2.utils.events import CommonMetricPrinter, JSONWriter

            return [CommonMetricPrinter(self.max_iter), JSONWriter(str(out / "metrics.json"))]

    decay_at = [float(f) for f in args.decay_at.split(",")]
    cfg = config(out, args.iters, args.seed, args.lr, decay_at, args.overrides)
    started = time.time()
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=True)
    trainer.train()
    spent = out / "train_seconds.json"  # training time over every run of this --out (resumed runs add up)
    seconds = (json.loads(spent.read_text()) if spent.is_file() else 0) + time.time() - started
    spent.write_text(json.dumps(round(seconds)))

    model = trainer.model.eval()
    evaluator = COCOEvaluator(HELD_OUT[0], tasks=("bbox",), distributed=False, output_dir=str(out / "eval"))
    from detectron2.data import build_detection_test_loader

    results = inference_on_dataset(model, build_detection_test_loader(cfg, HELD_OUT[0]), evaluator)
    record = {"config": str(CONFIG.relative_to(REPO)), "iterations": args.iters, "seed": args.seed,
              "precision": "bfloat16 autocast" if args.bf16 else "float32",
              "train": {"count": args.train_count, "seed": TRAIN[1], "size": args.size},
              "held_out": {"count": args.held_out_count, "seed": HELD_OUT[1], "size": args.size},
              "bbox": results["bbox"], "train_seconds": round(seconds),
              "command": "python training/train_box_fixture.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.fixture:
        fixture = Path(args.fixture)
        fixture.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
        tmp = fixture.with_suffix(".tmp")
        torch.save({"model": state, "__author__": "d2export training/train_box_fixture.py"}, tmp)
        tmp.replace(fixture)
        record["sha256"] = hashlib.sha256(fixture.read_bytes()).hexdigest()
        record["bytes"] = fixture.stat().st_size
        fixture.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    shutil.rmtree(out / "eval", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
