"""The micro spotter's training recipe (third_party/testr/configs/micro*.yaml): a model trained from scratch freezes
nothing and keeps no frozen norms on random weights; the text branch's sampling offsets learn at the full rate; a
picture without words trains; weights trained with frozen norms warm-start a model whose norms train."""
from pathlib import Path

import pytest
import torch

import testr_c_shim

testr_c_shim.install()
import testr  # noqa: E402,F401
from testr.config import get_cfg  # noqa: E402

CONFIGS = Path(testr.__file__).parent / "configs"
REPO = Path(__file__).resolve().parent.parent  # training/ (the fixtures' workshop) is imported from here
FROM_SCRATCH = ["micro.yaml", "micro_spotter.yaml"]


def _cfg(name, *overrides):
    cfg = get_cfg()
    cfg.merge_from_file(str(CONFIGS / name))
    cfg.merge_from_list(list(overrides))
    cfg.MODEL.DEVICE = "cpu"
    return cfg


def _model(cfg):
    from detectron2.modeling import build_model

    torch.manual_seed(0)
    return build_model(cfg)


@pytest.mark.parametrize("name", FROM_SCRATCH)
def test_a_from_scratch_config_freezes_nothing(name):
    from detectron2.layers import FrozenBatchNorm2d

    model = _model(_cfg(name))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == []
    assert not [n for n, m in model.named_modules() if isinstance(m, FrozenBatchNorm2d)]
    assert any("stem" in n for n, _ in model.named_parameters())


def test_the_frozen_recipe_is_what_the_test_above_refuses():
    """detectron2's default FREEZE_AT 2 (the recipe before this one): the stem and res2 frozen, FrozenBatchNorm2d."""
    from detectron2.layers import FrozenBatchNorm2d

    model = _model(_cfg("micro.yaml", "MODEL.BACKBONE.FREEZE_AT", "2"))
    assert [n for n, p in model.named_parameters() if not p.requires_grad]
    assert [n for n, m in model.named_modules() if isinstance(m, FrozenBatchNorm2d)]


@pytest.mark.parametrize("name", FROM_SCRATCH)
def test_the_text_branch_sampling_offsets_learn_at_the_base_rate(name):
    from testr.train import build_optimizer

    cfg = _cfg(name)
    model = _model(cfg)
    rate = {id(p): g["lr"] for g in build_optimizer(cfg, model).param_groups for p in g["params"]}
    offsets = {n: rate[id(p)] for n, p in model.named_parameters() if "sampling_offsets" in n}
    text = {n: r for n, r in offsets.items() if "text" in n}
    assert text, sorted(offsets)  # the composite decoder's text branch has its own attention
    assert set(offsets.values()) == {cfg.SOLVER.BASE_LR}
    old = _cfg(name, "SOLVER.LR_LINEAR_PROJ_MULT", "0.1")
    old_rates = {g["name"]: g["lr"] for g in build_optimizer(old, _model(old)).param_groups}
    assert old_rates["linear_proj"] == pytest.approx(0.1 * old.SOLVER.BASE_LR)  # the multiplier is what moves them


def test_the_text_branch_learns_at_its_own_rate_only_when_asked():
    """SOLVER.LR_TEXT_MULT: at 1 (upstream) the optimizer's groups are upstream's; at 10 the character slots'
    queries, attention and classifier learn at ten times the base rate, the location branch, the encoder and the
    backbone as before."""
    from testr.train import build_optimizer

    def rates(*overrides):
        cfg = _cfg("micro_spotter.yaml", *overrides)
        model = _model(cfg)
        by_id = {id(p): g["lr"] for g in build_optimizer(cfg, model).param_groups for p in g["params"]}
        return cfg, {n: by_id[id(p)] for n, p in model.named_parameters()}

    cfg, plain = rates()
    assert set(plain.values()) == {cfg.SOLVER.BASE_LR}  # micro.yaml: every group at 1e-3
    _, fast = rates("SOLVER.LR_TEXT_MULT", "10.0")
    changed = {n for n in plain if fast[n] != plain[n]}
    assert {"testr.text_class.weight", "testr.text_embed.weight"} <= changed
    assert any("attn_cross_text.attention_weights" in n for n in changed)
    assert all(fast[n] == pytest.approx(10 * cfg.SOLVER.BASE_LR) for n in changed)
    assert not [n for n in changed if "text" not in n or "sampling_offsets" in n]
    assert any("attn_cross.attention_weights" in n and n not in changed for n in plain)  # the location branch


def _picture(words: int, h=96, w=128):
    from detectron2.structures import Boxes, Instances

    inst = Instances((h, w))
    boxes = torch.tensor([[10.0, 12, 90, 40], [20, 50, 110, 80]])[:words]
    inst.gt_boxes, inst.gt_classes = Boxes(boxes), torch.zeros(words, dtype=torch.int64)
    if words:
        t = torch.linspace(0, 1, 8)
        inst.polygons = torch.stack([torch.cat([torch.stack([x0 + t * (x1 - x0), y0 + 0 * t], 1),
                                                torch.stack([x1 - t * (x1 - x0), y1 + 0 * t], 1)]).flatten()
                                     for x0, y0, x1, y1 in boxes.tolist()])
        inst.text = torch.randint(0, 96, (words, 25), dtype=torch.int32)
    return {"image": torch.rand(3, h, w) * 255, "instances": inst}


def test_a_picture_without_words_trains(monkeypatch):
    """The mapper gives a picture without annotations an Instances without text fields; the batch still trains."""
    import math

    from testr.data import DatasetMapperWithBasis
    from testr.layers import ms_deform_attn
    from testr.train import build_optimizer, train_step

    from d2export.patching.compiled_ops import make_stand_in

    monkeypatch.setattr(ms_deform_attn, "_C", make_stand_in("testr._C"))
    cfg = _cfg("micro.yaml", "MODEL.TRANSFORMER.ENC_LAYERS", "1", "MODEL.TRANSFORMER.DEC_LAYERS", "1")
    model = _model(cfg)
    empty = _picture(0)
    assert not empty["instances"].has("polygons")  # as the mapper leaves such a picture (checked below)
    losses = train_step(model, build_optimizer(cfg, model), [_picture(2), empty])
    assert all(math.isfinite(v) for v in losses.values()), losses
    only_empty = train_step(model, build_optimizer(cfg, model), [_picture(0)])
    assert math.isfinite(only_empty["total"])


def test_the_mapper_leaves_a_picture_without_words_without_text_fields(tmp_path):
    import numpy as np
    from PIL import Image
    from testr.data import DatasetMapperWithBasis

    Image.fromarray(np.zeros((64, 80, 3), np.uint8)).save(tmp_path / "a.png")
    cfg = _cfg("micro.yaml")
    record = DatasetMapperWithBasis(cfg, is_train=True)({"file_name": str(tmp_path / "a.png"), "height": 64,
                                                         "width": 80, "image_id": 0, "annotations": []})
    assert len(record["instances"]) == 0 and not record["instances"].has("polygons")


def test_frozen_norm_weights_warm_start_a_model_whose_norms_train(tmp_path):
    """A checkpoint of the frozen recipe (no BatchNorm step counters) loads into today's; anything else missing
    still refuses."""
    from testr.train import load_checkpoint, save_checkpoint

    old = _model(_cfg("micro.yaml", "MODEL.BACKBONE.FREEZE_AT", "2"))
    save_checkpoint(tmp_path / "old.pth", old)
    new = _model(_cfg("micro.yaml"))
    load_checkpoint(tmp_path / "old.pth", new)
    for k, v in old.state_dict().items():
        assert torch.equal(new.state_dict()[k], v), k
    state = torch.load(tmp_path / "old.pth", weights_only=False)
    del state["model"]["testr.ctrl_point_embed.weight"]
    torch.save(state, tmp_path / "broken.pth")
    with pytest.raises(RuntimeError, match="ctrl_point_embed"):
        load_checkpoint(tmp_path / "broken.pth", new)


def test_the_stream_draws_the_sets_pictures_in_order_whatever_the_workers(tmp_path):
    """Stream picture i is picture i of `d2export synth text` of the same seed (same pixels, same labels as the
    catalog loads them); its batches are the same with 0 or 2 workers, and a stream started at batch 2 begins with
    the batch the first stream gave third."""
    import numpy as np
    from detectron2.data import DatasetCatalog
    from functools import partial
    from testr.data import DatasetMapperWithBasis
    from testr.data.stream import stream

    from d2export.datasets import generate, register
    from d2export.datasets.catalog import text_record

    size = (96, 64)
    generate("text", tmp_path / "set", count=6, seed=3, size=size, workers=1)
    on_disk = DatasetCatalog.get(register("stream_case", tmp_path / "set"))
    for i in (0, 5):
        drawn, saved = text_record(3, i, size), on_disk[i]
        from detectron2.data.detection_utils import read_image

        assert np.array_equal(drawn["image"], read_image(saved["file_name"], format="RGB"))
        keep = ("bbox", "bbox_mode", "category_id", "polygons", "beziers", "text")
        assert [{k: a[k] for k in keep} for a in drawn["annotations"]] == \
            [{k: a[k] for k in keep} for a in saved["annotations"]]

    cfg = _cfg("micro.yaml", "INPUT.MIN_SIZE_TRAIN", "(48, 64, 80)")
    draw, mapper = partial(text_record, 3, size=size), DatasetMapperWithBasis(cfg, is_train=True)

    def first(n, **kw):
        it = stream(draw, mapper, 2, seed=7, **kw)
        return [[(tuple(r["image"].shape), r["image_id"], len(r["instances"])) for r in next(it)] for _ in range(n)]

    alone, shared = first(3, workers=0), first(3, workers=2)
    assert alone == shared
    assert [[i for _, i, _ in b] for b in alone] == [[1, 2], [3, 4], [5, 6]]  # image ids: index + 1
    assert len({s for b in alone for s, _, _ in b}) > 1  # the training sizes are drawn
    assert first(1, workers=0, start=2) == alone[2:]


def test_slot_references_give_each_character_slot_its_share_of_the_box():
    """By hand: a box centred at 0.5, 0.8 wide, 4 slots: centres 0.2, 0.4, 0.6, 0.8, each 0.4 wide; y and h kept.
    Off (upstream), every slot's text queries sample around the whole box."""
    from testr.layers.deformable_transformer import slot_boxes

    boxes = torch.tensor([0.5, 0.3, 0.8, 0.1]).expand(1, 2, 4, 3, 4)  # (B, Q, S=4, L=3, 4)
    out = slot_boxes(boxes)
    expected = torch.tensor([[0.2, 0.3, 0.4, 0.1], [0.4, 0.3, 0.4, 0.1], [0.6, 0.3, 0.4, 0.1], [0.8, 0.3, 0.4, 0.1]])
    assert torch.allclose(out[0, 1, :, 2], expected, atol=1e-6) and torch.equal(out[:, :, :, 0], out[:, :, :, 2])
    on = _model(_cfg("micro.yaml", "MODEL.TRANSFORMER.TEXT_SLOT_REFERENCES", "True"))
    assert all(layer.slot_references for layer in on.testr.transformer.decoder.layers)
    assert not any(layer.slot_references for layer in _model(_cfg("micro.yaml")).testr.transformer.decoder.layers)


def _slot_placement(model, images) -> dict:
    """Where each character slot's text queries look, in the last decoder layer: the attention-weighted mean of
    their sampling points' x offset from their proposal's box centre, in box widths (averaged over heads, queries
    and `images`, a list of mapped test records), and how far apart one query's slots look (the mean over queries
    of the slots' standard deviation)."""
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


def test_each_character_slot_looks_at_its_share_of_the_box():
    """Where each character slot looks on freshly built models (sampling offsets a symmetric ring, uniform
    attention): every slot looks at the box's centre (upstream), or, with slot references (micro_spotter.yaml's
    TEXT_SLOT_REFERENCES), at the centre of its share of the box: (s + 0.5) / 8 - 0.5 box widths, by hand."""
    images = [{"image": torch.rand(3, 96, 128) * 255, "height": 96, "width": 128}]
    upstream = _slot_placement(_model(_cfg("micro.yaml")), images)
    assert upstream["slot_spread"] < 1e-5 and max(map(abs, upstream["slot_x"])) < 1e-5
    spread = _slot_placement(_model(_cfg("micro.yaml", "MODEL.TRANSFORMER.TEXT_SLOT_REFERENCES", "True")), images)
    assert spread["slot_x"] == pytest.approx([(s + 0.5) / 8 - 0.5 for s in range(8)], abs=2e-3)


def _slot_logits(slots: list[int], classes=97, margin=12.0):
    """(1, T, classes) logits, each slot sure of its class."""
    logits = torch.zeros(1, len(slots), classes)
    logits[0, torch.arange(len(slots)), torch.tensor(slots)] = margin
    return logits


def test_ctc_reads_a_word_from_any_placement_of_its_characters():
    """TEXT_CTC: slots "c c a <none> t t <none> <none>" spell "cat" (runs collapse, "no character" is the blank), so
    the CTC loss is near 0 where the per-slot cross-entropy (the upstream loss) is high; slots that spell another
    word ("cta") or repeat a letter without a blank between ("caat" read as "cat" is not "caat") cost as much either
    way. The evaluator's decoding reads the same slots as the loss."""
    from testr.modeling.testr.criterion import SetCriterion

    from d2export.charset import decode

    loss_cfg = _cfg("micro.yaml").MODEL.TRANSFORMER.LOSS
    ctc, slots = SetCriterion(loss_cfg, 96, ctc=True), SetCriterion(loss_cfg, 96)
    c, a, t, none = 67, 65, 84, 96  # ids in the 96-class charset: chr(id + 32)
    chars = [chr(i + 32) for i in range(95)]
    cat = torch.tensor([[c, a, t] + [none] * 5])
    spread = _slot_logits([c, c, a, none, t, t, none, none])
    assert decode([c, c, a, none, t, t, none, none], chars, ctc=True) == "cat"
    assert float(ctc.text_loss(spread, cat)) < 0.01
    assert float(slots.text_loss(spread, cat)) > 1.0
    assert float(ctc.text_loss(_slot_logits([c, t, a] + [none] * 5), cat)) > 1.0
    caat = torch.tensor([[c, a, a, t] + [none] * 4])
    assert float(ctc.text_loss(_slot_logits([c, a, a, t] + [none] * 4), caat)) > 1.0
    assert float(ctc.text_loss(_slot_logits([c, a, none, a, t] + [none] * 3), caat)) < 0.01


def test_ctc_trained_slots_are_read_as_ctc_by_the_export():
    """The TESTR family's manifest says how the slots read: "ctc" where the config trained them so, else "slots"."""
    from d2export.families.testr import FAMILY

    assert FAMILY.postprocess(_cfg("micro_spotter.yaml"))["text_decoding"] == "slots"
    on = _cfg("micro_spotter.yaml", "MODEL.TRANSFORMER.TEXT_CTC", "True")
    assert FAMILY.postprocess(on)["text_decoding"] == "ctc"


def test_character_centres_lie_along_the_midline_by_hand():
    """A straight word from x 0.1 to 0.5 between y 0.2 (top) and 0.4 (bottom), 4 points a side; "ab" → centres at
    u = 1/4 and 3/4: x 0.2 and 0.4, y 0.3; padding slots give none."""
    from testr.modeling.testr.criterion import character_centres

    xs = torch.linspace(0.1, 0.5, 4)
    top = torch.stack([xs, torch.full((4,), 0.2)], -1)
    bottom = torch.stack([xs.flip(0), torch.full((4,), 0.4)], -1)  # right to left
    points = torch.cat([top, bottom])[None]
    centres, ids = character_centres(points, torch.tensor([[65, 66, 96, 96]]), 96)
    torch.testing.assert_close(centres, torch.tensor([[0.2, 0.3], [0.4, 0.3]]))
    assert ids.tolist() == [65, 66]


def test_the_char_centre_loss_reads_the_feature_map_where_the_characters_are():
    """A feature map that holds one-hot class vectors exactly at two characters' cells and nothing elsewhere: a
    classifier that is the identity scores a low loss there; the same map with the characters swapped, a high one."""
    from testr.modeling.testr.criterion import char_centre_loss

    voc, (h, w) = 4, (8, 16)
    features = torch.zeros(1, voc, h, w)
    # a 64 x 128 picture, stride 8: the centres of cells (4, 3) and (4, 9) at x 28 and 76 px, y 36 px
    features[0, 1, 4, 3] = features[0, 2, 4, 9] = 50.0
    identity = torch.nn.Linear(voc, voc, bias=False)
    identity.weight.data = torch.eye(voc)
    xs = torch.tensor([4.0, 52.0, 100.0]) / 128  # the outline from x 4 to 100 px: "ab" centred at 28 and 76 px
    top = torch.stack([xs, torch.full((3,), 28.0 / 64)], -1)
    bottom = torch.stack([xs.flip(0), torch.full((3,), 44.0 / 64)], -1)
    target = {"ctrl_points": torch.cat([top, bottom])[None], "texts": torch.tensor([[1, 2, voc]])}
    right = char_centre_loss(identity, features, [target], [(64, 128)], (64, 128), voc)
    target["texts"] = torch.tensor([[2, 1, voc]])
    wrong = char_centre_loss(identity, features, [target], [(64, 128)], (64, 128), voc)
    assert float(right) < 0.1 < 10.0 < float(wrong)


def test_the_char_centre_classifier_trains_and_never_ships(tmp_path):
    """On: a loss beside the others from a picture with words, a fresh classifier warm-starting from weights without
    it; the float16 snapshot (what exports and serves) has none of it."""
    from testr.train import load_checkpoint, save_checkpoint, save_weights_fp16

    cfg = _cfg("micro.yaml", "MODEL.TRANSFORMER.LOSS.CHAR_CENTRE_WEIGHT", "1.0")
    model = _model(cfg)
    model.train()
    losses = model([_picture(2)])
    assert float(losses["loss_char_centres"]) > 0
    plain = _model(_cfg("micro.yaml"))
    save_checkpoint(tmp_path / "plain.pth", plain, iteration=3)
    assert load_checkpoint(tmp_path / "plain.pth", model) == 3
    save_weights_fp16(tmp_path / "half.pth", model)
    assert not [k for k in torch.load(tmp_path / "half.pth")["model"] if k.startswith("char_centre_class")]
    load_checkpoint(tmp_path / "half.pth", plain)


def test_glyph_pretraining_reads_each_character_where_it_was_drawn():
    """The glyph pretraining's centres (training/common.py) from a mapped synthetic picture (resized by the mapper)
    are the band's midline at each glyph's centre, in the mapped picture's pixels; training/pretrain_glyphs.py's
    classifier gets one row per character."""
    import sys

    import numpy as np

    from d2export.datasets import synth
    from d2export.datasets.catalog import text_record
    from d2export.datasets.text import glyph_centres
    from testr.data import DatasetMapperWithBasis

    sys.path.insert(0, str(REPO))
    from training import common, pretrain_glyphs

    cfg = _cfg("micro_spotter.yaml", "INPUT.MIN_SIZE_TEST", "320")  # as step 1 of the recipe read
    mapper = DatasetMapperWithBasis(cfg, is_train=True)
    mapper.augmentation = DatasetMapperWithBasis(cfg, is_train=False).augmentation  # 240 → 320 px: a scale of 4/3
    record = mapper(text_record(5, 3, size=(240, 240)))
    _, instances = synth.draw("text", 5, 3, 240, 240)
    from d2export.charset import charset

    points, ids = common.centres(record["instances"], 96, charset(96))
    expected = np.concatenate([i["band"].at(np.asarray(glyph_centres(i["word"])), 0.5) for i in instances])
    np.testing.assert_allclose(points.numpy(), expected * 320 / 240, atol=0.05)
    assert len(ids) == sum(len(i["word"]) for i in instances) > 0

    reader = pretrain_glyphs.GlyphReader(_model(cfg), 96)
    logits, labels = reader.logits([record])
    assert logits.shape == (len(ids), 96) and labels.tolist() == ids.tolist()
    assert all(p.requires_grad for p in reader.parameters())


def test_the_feature_probe_reads_the_projected_map_or_the_encoders_memory(tmp_path):
    """training/probe_features.py samples a feature per character of a synthetic picture, from the projected stride-8
    map or from the encoder's memory at the same level (the tokens of that level, back in their grid): the two
    differ, and a level's memory is not another level's."""
    import sys

    from d2export.datasets import generate, register
    from detectron2.data import DatasetCatalog
    from testr.data import DatasetMapperWithBasis

    sys.path.insert(0, str(REPO))
    from training import probe_features

    generate("text", tmp_path / "pics", count=2, seed=5, size=(240, 320))
    register("probe_features_test", tmp_path / "pics")
    records = DatasetCatalog.get("probe_features_test")
    cfg = _cfg("micro_spotter.yaml")
    model = _model(cfg).eval()
    mapper = DatasetMapperWithBasis(cfg, is_train=False)
    chars = sum(len([c for c in a["rec"] if c < 96]) for r in records for a in r["annotations"])
    projected, ids = probe_features.sampled(model, mapper, records, 0, 96)
    memory, same_ids = probe_features.sampled(model, mapper, records, 0, 96, "memory")
    coarser, _ = probe_features.sampled(model, mapper, records, 1, 96, "memory")
    assert projected.shape == memory.shape == (chars, 128) and ids.tolist() == same_ids.tolist()
    assert not torch.allclose(projected, memory) and not torch.allclose(memory, coarser)


def test_glyph_reading_samples_each_character_where_it_was_drawn():
    """common.read_glyphs on a map whose channels are its own cells' pixel coordinates, spanning a padded
    batch larger than the picture: the features it reads are the glyphs' centres (to the bilinear grid's accuracy),
    so a map shifted by a cell is read a cell off."""
    import sys

    from d2export.charset import charset
    from d2export.datasets.catalog import text_record
    from testr.data import DatasetMapperWithBasis

    sys.path.insert(0, str(REPO))
    from training import common

    cfg = _cfg("micro_spotter.yaml", "INPUT.MIN_SIZE_TEST", "320")
    mapper = DatasetMapperWithBasis(cfg, is_train=True)
    mapper.augmentation = DatasetMapperWithBasis(cfg, is_train=False).augmentation
    record = mapper(text_record(5, 3, size=(240, 320)))  # mapped to 320 x 427: padded below to 480 x 448
    points, _ = common.centres(record["instances"], 96, charset(96))
    padded_w, padded_h, stride = 480, 448, 8
    ys, xs = torch.meshgrid(torch.arange(padded_h // stride), torch.arange(padded_w // stride), indexing="ij")
    fmap = torch.stack([(xs + 0.5) * stride, (ys + 0.5) * stride]).float()[None]  # each cell's centre, in pixels
    identity = torch.nn.Identity()
    read, labels = common.read_glyphs(identity, fmap, (padded_w, padded_h), [record], 96, charset(96))
    assert len(labels) == len(points) > 0
    torch.testing.assert_close(read, points, atol=1e-3, rtol=0)
    shifted, _ = common.read_glyphs(identity, fmap + stride, (padded_w, padded_h), [record], 96, charset(96))
    assert (shifted - points).abs().min() > stride - 1e-3


def test_the_glyph_loss_trains_the_encoder_and_the_backbone_under_the_spotter(monkeypatch):
    """GlyphLoss adds "loss_glyphs" to the spotter's training losses only (not at inference), read from the memory by
    default: its gradient reaches the encoder and the backbone; read from the projected map, it does not reach the
    encoder. Its classifier is not the model's (what serves has none)."""
    import sys

    from d2export.datasets.catalog import text_record
    from d2export.patching.compiled_ops import make_stand_in
    from testr.data import DatasetMapperWithBasis
    from testr.layers import ms_deform_attn

    sys.path.insert(0, str(REPO))
    from training import common

    monkeypatch.setattr(ms_deform_attn, "_C", make_stand_in("testr._C"))  # with a backward
    cfg = _cfg("micro_spotter.yaml")
    mapper = DatasetMapperWithBasis(cfg, is_train=True)
    batch = [mapper(text_record(5, i, size=(160, 224))) for i in (3, 4)]
    for where, reaches_encoder in (("memory", True), ("projected", False)):
        torch.manual_seed(0)
        model = _model(cfg).train()
        names = set(dict(model.named_parameters()))
        glyphs = common.GlyphLoss(model, 2.0, where)
        losses = model(batch)
        assert set(dict(model.named_parameters())) == names and float(losses["loss_glyphs"].detach()) > 0
        losses["loss_glyphs"].backward()
        grad = {n: p.grad for n, p in model.named_parameters()}
        assert grad["testr.input_proj.0.0.weight"].abs().sum() > 0 and glyphs.head.weight.grad.abs().sum() > 0
        assert all(g is None or g.abs().sum() == 0 for n, g in grad.items() if "decoder" in n)
        encoder = [g for n, g in grad.items() if ".encoder." in n]
        assert any(g is not None and g.abs().sum() > 0 for g in encoder) == reaches_encoder
        model.eval()
        with torch.no_grad():
            assert "loss_glyphs" not in model([batch[0]])[0]


def test_the_decoder_probe_reads_what_the_spotter_reads(tmp_path):
    """training/probe_decoder.py caches what the decoder samples and runs the decoder alone on it (its location branch
    on one control point, unused): at the model's own references its character logits equal the whole spotter's, every
    word read by one query; at the true boxes they equal the spotter's when its decoder is handed the same boxes, its
    other queries the probe's spare box (two pictures at once, a random model). Read from the projected maps
    instead, they differ."""
    import sys

    from d2export.datasets import generate, register
    from detectron2.data import DatasetCatalog
    from testr.data import DatasetMapperWithBasis

    sys.path.insert(0, str(REPO))
    from training import probe_decoder

    generate("text", tmp_path / "pics", count=2, seed=5, size=(320, 320))
    register("probe_decoder_test", tmp_path / "pics")
    records = DatasetCatalog.get("probe_decoder_test")
    cfg = _cfg("micro_spotter.yaml", "MODEL.TRANSFORMER.TEXT_SLOT_REFERENCES", "True")
    model = _model(cfg).eval()
    mapper = DatasetMapperWithBasis(cfg, is_train=True)
    mapper.augmentation = DatasetMapperWithBasis(cfg, is_train=False).augmentation
    data = probe_decoder.cache(model, mapper, records, half=False)
    only = probe_decoder.cache(model, mapper, records, keep=("memory",))  # what a run keeps: its --source alone
    assert "projected" not in only and only["memory"].dtype == torch.float16
    torch.testing.assert_close(only["memory"].float(), data["memory"], atol=2e-2, rtol=1e-3)
    queries = model.testr.num_proposals
    with torch.no_grad():
        logits, reads = probe_decoder.text_logits(model, data, [0, 1], "memory", queries)
        own, own_reads = probe_decoder.text_logits(model, data, [0, 1], "memory", queries, "own")
        projected, _ = probe_decoder.text_logits(model, data, [0, 1], "projected", queries)
    words = [len(b) for b in data["boxes"]]
    assert (reads >= 0).sum() == sum(words) > 2
    assert [sorted(r[r >= 0].tolist()) for r in own_reads] == [list(range(n)) for n in words]

    boxes = {}

    def true_boxes(decoder, args):  # the first n queries' references become the picture's n words' boxes
        refs = torch.tensor(probe_decoder.SPARE_BOX).repeat(*args[2].shape[:2], 1)
        refs[0, :len(boxes["now"])] = boxes["now"]
        return (args[0], args[1], refs, *args[3:])

    for b, record in enumerate(records):
        item = mapper(record)
        with torch.no_grad():
            spotter = model.testr(model.preprocess_image([item]))["pred_texts"][0]
        torch.testing.assert_close(own[-1, b], spotter, atol=1e-4, rtol=1e-4)
        boxes["now"] = data["boxes"][b]
        hook = model.testr.transformer.decoder.register_forward_pre_hook(true_boxes)
        try:
            with torch.no_grad():
                whole = model.testr(model.preprocess_image([item]))["pred_texts"][0, :words[b]]
        finally:
            hook.remove()
        torch.testing.assert_close(logits[-1, b, :words[b]], whole, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(projected[-1, b, :words[b]], whole, atol=1e-2)
        assert not torch.allclose(own[-1, b, :words[b]], whole, atol=1e-2)


def test_glyph_pretraining_drops_its_rate_at_the_step_asked_and_resumes_there(tmp_path):
    """training/pretrain_glyphs.py --decay-at 3: steps 1-3 learn at --lr, steps 4 on at a tenth, also in a run that
    resumes from last.pth past the decay; every checkpoint's row and the record say so."""
    import json
    import subprocess
    import sys

    script = str(REPO / "training" / "pretrain_glyphs.py")
    small = ["--out", str(tmp_path), "--batch", "1", "--eval-every", "2", "--eval-count", "2", "--size", "128x160",
             "--threads", "1", "--lr", "2e-3", "--decay-at", "3"]
    for steps in ("4", "6"):
        subprocess.run([sys.executable, script, "--steps", steps, *small], check=True, capture_output=True,
                       timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # each row: the rate of the step that ended at it
    assert [(r["step"], r["lr"]) for r in rows] == [(2, 2e-3), (4, pytest.approx(2e-4)), (6, pytest.approx(2e-4))]
    record = json.loads((tmp_path / "model.json").read_text())
    assert record["train"]["decay_at"] == 3 and record["steps"] == 6


def test_the_decoder_stage_writes_a_fixture_whose_detection_is_its_inits(tmp_path):
    """training/probe_decoder.py --fixture, the recipe's last stage: from given weights, two steps at their own
    references move the text branch and nothing else (detection is exactly --init's), then the float16 weights are
    scored on another seed and written with a record that keeps --init's sha256 and the test size it was scored at.
    A run that --minutes cuts short of --steps writes none."""
    import hashlib
    import json
    import subprocess
    import sys

    import yaml
    from testr.train import save_weights_fp16

    repo = Path(__file__).resolve().parent.parent
    overrides = ["MODEL.TRANSFORMER.TEXT_SLOT_REFERENCES", "True"]
    init = tmp_path / "init.pth"
    save_weights_fp16(init, _model(_cfg("micro_spotter.yaml", *overrides)))
    fixture = tmp_path / "fixture" / "spotter.pth"
    command = [sys.executable, str(repo / "training" / "probe_decoder.py"), "--init", str(init), "--out",
               str(tmp_path / "out"), "--data", str(tmp_path / "train"), "--count", "2", "--validation",
               str(tmp_path / "validation"), "--validation-count", "2", "--references", "own", "--steps", "2",
               "--lr", "1e-3", "--decay-at", "1", "--eval-every", "1", "--batch", "2", "--fixture", str(fixture),
               "--final-count", "2", "--final-seed", "5", *overrides]
    cut = subprocess.run(command[:2] + ["--minutes", "0"] + command[2:], capture_output=True, text=True, timeout=600)
    assert cut.returncode == 1 and "no fixture written" in cut.stderr and not fixture.parent.exists()
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    record = json.loads(fixture.with_suffix(".json").read_text())
    config = yaml.safe_load((repo / "third_party/testr/configs/micro_spotter.yaml").read_text())["INPUT"]
    assert record["held_out"]["read_at"] == {"min_size": config["MIN_SIZE_TEST"], "max_size": config["MAX_SIZE_TEST"]}
    assert record["sha256"] == hashlib.sha256(fixture.read_bytes()).hexdigest()
    assert record["init"]["sha256"] == hashlib.sha256(init.read_bytes()).hexdigest()
    assert record["held_out"]["seed"] == 5 and "det_hmean" in record["held_out"] and record["iterations"] == 2
    assert record["command"].startswith("python training/probe_decoder.py") and "--fixture" in record["command"]
    assert [row["lr"] for row in record["curve"]] == pytest.approx([1e-3, 1e-3, 1e-4])  # the second step ran at a tenth
    before = torch.load(init, weights_only=False)["model"]
    after = torch.load(fixture, weights_only=False)["model"]
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert "testr.text_class.weight" in moved and any(".attn_cross_text." in k for k in moved)
    assert all("text" in k for k in moved)  # the backbone, encoder, proposals and location branch as they were
