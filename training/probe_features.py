"""Do a spotter's features tell characters apart? A linear classifier on the TESTR stand-in's projected feature maps
(what its decoder samples; `--level`, 0: stride 8), read at each character's centre, trained on pictures of one set
and scored on another. If it reads few characters, the recognition head cannot read more; if it reads many and the
spotter does not, the head (where its slots look, how they are trained) is what fails.

Character centres are where the renderer centred each glyph along the word's band (`glyph_centres`). The linear-probe
figures behind the recipe's settings (docs/training.md) are this probe's; `benchmarks/gpu_session.sh recipe` runs it
on the pretrained weights.

    python training/probe_features.py --weights tests/data/spotter_fixture.pth \\
        --config third_party/testr/configs/micro_spotter.yaml
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "third_party")]
from training.common import cpu_spotter, word_points  # noqa: E402


def centres(annotation: dict, voc_size: int) -> tuple[list[list[float]], list[int]]:
    """A word's character centres (picture pixels: where the renderer centred each glyph) and their class ids."""
    from d2export.charset import charset

    points, ids = word_points(annotation["bezier_pts"], annotation["rec"], voc_size, charset(voc_size))
    return ([] if points is None else points.tolist()), ids


def sampled(model, mapper, records, level: int, voc_size: int, where: str = "projected"):
    """(features at every character centre [n, C], class ids [n]) over `records`; `where`: the projected map
    (input_proj) or the encoder's memory there (what the decoder's text queries sample)."""
    import torch
    import torch.nn.functional as F

    maps, memory = [], []  # every level's projected map, in order; the encoder's output
    hooks = [proj.register_forward_hook(lambda m, i, o: maps.append(o)) for proj in model.testr.input_proj]
    if where == "memory":
        hooks.append(model.testr.transformer.encoder.register_forward_hook(lambda m, i, o: memory.append(o)))
    xs, ys = [], []
    try:
        with torch.no_grad():
            for record in records:
                maps.clear()
                memory.clear()
                item = mapper(record)
                model([item])
                fmap = maps[level]  # [1, C, h, w] of the resized, padded input
                if memory:  # [1, tokens, C], the levels' maps flattened one after the other
                    sizes = [m.shape[-2] * m.shape[-1] for m in maps]
                    start = sum(sizes[:level])
                    fmap = memory[0][:, start:start + sizes[level]].transpose(1, 2).reshape(fmap.shape)
                scale = item["image"].shape[-1] / record["width"]  # the test mapper's resize
                stride = item["image"].shape[-1] / fmap.shape[-1]
                for ann in record["annotations"]:
                    points, ids = centres(ann, voc_size)
                    if not ids:
                        continue
                    p = torch.tensor(points, dtype=torch.float32) * scale / stride  # feature-map cells
                    h, w = fmap.shape[-2:]
                    # align_corners=False: the map spans [-1, 1] edge to edge, as the picture spans its pixels
                    grid = torch.stack([p[:, 0] / w * 2 - 1, p[:, 1] / h * 2 - 1], -1)
                    xs.append(F.grid_sample(fmap, grid[None, None], align_corners=False)[0, :, 0].T)
                    ys += ids
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(xs), torch.tensor(ys)


def fit_and_score(train, test, classes: int, steps: int = 300) -> dict:
    """Logistic regression (standardised features, weight decay) on `train`, accuracy on `test`."""
    import torch

    (x, y), (xt, yt) = train, test
    mean, std = x.mean(0), x.std(0) + 1e-6
    x, xt = (x - mean) / std, (xt - mean) / std
    torch.manual_seed(0)
    linear = torch.nn.Linear(x.shape[1], classes)
    optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-2, weight_decay=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(linear(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = float((linear(xt).argmax(1) == yt).float().mean())
    commonest = int(torch.bincount(y).argmax())
    return {"char_accuracy": round(100 * accuracy, 1),
            "always_commonest": round(100 * float((yt == commonest).float().mean()), 1),
            "train_chars": len(y), "test_chars": len(yt)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="a checkpoint or the float16 fixture")
    ap.add_argument("--config", default=str(REPO / "third_party/testr/configs/micro_spotter.yaml"))
    ap.add_argument("--train", default="outputs/probe/data", help="pictures to fit on (seed 0, made if absent)")
    ap.add_argument("--test", default="outputs/probe/data_validation_100", help="pictures to score on (seed 2)")
    ap.add_argument("--train-count", type=int, default=300)
    ap.add_argument("--level", type=int, default=0, help="feature level (0: stride 8)")
    ap.add_argument("--where", choices=["projected", "memory"], default="projected",
                    help="the projected map (input_proj) or the encoder's memory (what the text queries sample)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY VALUE pairs")
    args = ap.parse_args(argv)

    cfg, model = cpu_spotter(args.config, args.overrides, args.threads, args.weights)
    from detectron2.data import DatasetCatalog
    from testr.data import DatasetMapperWithBasis

    from d2export.datasets import generate, register

    for name, folder, seed, count in (("features_train", args.train, 0, 1000), ("features_test", args.test, 2, 100)):
        if not (Path(folder) / "annotations.json").is_file():
            generate("text", Path(folder), count=count, seed=seed, size=(320, 320))
        register(name, Path(folder))
    model.eval()
    mapper = DatasetMapperWithBasis(cfg, is_train=False)
    voc = int(cfg.MODEL.TRANSFORMER.VOC_SIZE)
    train = sampled(model, mapper, DatasetCatalog.get("features_train")[:args.train_count], args.level, voc,
                    args.where)
    test = sampled(model, mapper, DatasetCatalog.get("features_test"), args.level, voc, args.where)
    result = {"weights": args.weights, "level": args.level, "where": args.where, **fit_and_score(train, test, voc)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
