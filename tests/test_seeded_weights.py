"""Seeded random weights that look like a model's: a family's degenerate heads scaled (recorded in the manifest's
weights), a user's checkpoint never touched, and families without such heads left as seeded."""
from __future__ import annotations

from pathlib import Path

import torch

from d2export import building, pipeline
from d2export.config import load

REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, *more):
    return load("rcnn", [f"export.output_dir={tmp_path}", *more])


def test_seeded_rcnn_heads_are_scaled_and_recorded(tmp_path):
    cfg = _cfg(tmp_path)
    raw, _ = building.build_model(cfg.model, building.load_config(cfg.model, REPO), REPO)  # the same seed
    built = pipeline.prepare(cfg)
    assert built.weights["kind"] == "seeded (conditioned)"
    got, seeded = dict(built.model.named_parameters()), dict(raw.named_parameters())
    box = [n for n in built.weights["conditioned"] if "bbox_pred" in n]
    assert box and all(torch.equal(got[n], seeded[n] * 0.01) for n in box)
    others = [n for n in got if n not in built.weights["conditioned"]]
    assert others and all(torch.equal(got[n], seeded[n]) for n in others)


def test_seeded_backbone_norms_give_standardised_outputs_on_the_dummy_picture(tmp_path):
    from detectron2.layers import FrozenBatchNorm2d

    from d2export.tracing import dummy_images

    cfg = _cfg(tmp_path)
    built = pipeline.prepare(cfg)
    norms = {n: m for n, m in built.model.named_modules() if isinstance(m, FrozenBatchNorm2d)}
    assert norms and sorted(built.weights["normalised"]) == sorted(norms)
    seen = {}

    def keep(name, output):
        seen.setdefault(name, output.double())

    hooks = [m.register_forward_hook(lambda m, i, o, n=n: keep(n, o)) for n, m in norms.items()]
    image = dummy_images(cfg.export.dummy_sizes, cfg.model.seed)[0]
    with torch.no_grad():
        built.model([{"image": torch.from_numpy(image).float()}])
    for h in hooks:
        h.remove()
    assert set(seen) == set(norms)
    for name, out in seen.items():  # float64 statistics of float32 outputs: standardised to float32's precision
        assert abs(out.mean().item()) < 1e-4 and abs(out.std().item() - 1) < 1e-4, name


def test_a_checkpoint_is_never_conditioned(tmp_path):
    cfg = _cfg(tmp_path)
    raw, _ = building.build_model(cfg.model, building.load_config(cfg.model, REPO), REPO)
    torch.save({"model": raw.state_dict()}, tmp_path / "user.pth")
    built = pipeline.prepare(_cfg(tmp_path, f"model.weights={tmp_path / 'user.pth'}"))
    assert "kind" not in built.weights and built.weights["path"].endswith("user.pth")
    assert all(torch.equal(p, raw.state_dict()[n]) for n, p in built.model.state_dict().items())


def test_text_spotters_keep_plain_seeded_weights(tmp_path):
    built = pipeline.prepare(load("textdet_tiny", [f"export.output_dir={tmp_path}"]))
    assert built.weights == {"path": None, "random_seed": 0, "kind": "seeded"}  # no degenerate head declared
