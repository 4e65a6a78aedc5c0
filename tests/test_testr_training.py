"""Training for the TESTR stand-in (third_party/testr): the matchers against hand-built costs, each loss against a
hand-computed value, three steps on a fixed batch lowering the loss, and a trainer checkpoint of the R-50
configuration loading strictly with upstream's keys and shapes."""
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import testr_c_shim

testr_c_shim.install()
import testr  # noqa: E402,F401
from testr.config import get_cfg  # noqa: E402
from testr.modeling.testr.criterion import SetCriterion  # noqa: E402
from testr.modeling.testr.matcher import (BoxHungarianMatcher, CtrlPointHungarianMatcher, assign,  # noqa: E402
                                          focal_class_cost)

CONFIGS = Path(testr.__file__).parent / "configs"
DATA = Path(__file__).parent / "data"
P_HALF_POS = 0.25 * 0.25 * math.log(2)  # focal loss of p = 0.5 for a positive: alpha (1 - p)^gamma (-log p)
P_HALF_NEG = 0.75 * 0.25 * math.log(2)  # and for a negative: (1 - alpha) p^gamma (-log(1 - p))


def test_hungarian_assignment_takes_the_cheapest_one_to_one_pairs():
    cost = torch.tensor([[1.0, 5.0], [2.0, 1.0], [4.0, 4.0]])  # 3 queries, 2 words: best total 1 + 1
    (rows, cols), = assign([cost])
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]
    cost = torch.tensor([[1.0, 2.0], [1.5, 9.0]])  # greedy would take (0, 0) then (1, 1) = 10; optimum 3.5
    (rows, cols), = assign([cost])
    assert dict(zip(rows.tolist(), cols.tolist())) == {0: 1, 1: 0}
    (rows, cols), = assign([torch.zeros(3, 0)])
    assert len(rows) == len(cols) == 0


def test_point_matcher_cost_is_class_plus_point_l1():
    assert float(focal_class_cost(torch.tensor(0.5), 0.25, 2.0)) == pytest.approx(P_HALF_POS - P_HALF_NEG)
    points = torch.tensor([[[0.1, 0.1], [0.3, 0.1]],  # query 0: on word 1
                           [[0.5, 0.5], [0.9, 0.5]],  # query 1: on word 0, off by 0.1 in one x
                           [[0.0, 0.0], [0.0, 0.0]]])  # query 2: nowhere
    outputs = {"pred_logits": torch.zeros(1, 3, 2, 1), "pred_ctrl_points": points[None]}
    words = torch.tensor([[[0.5, 0.5], [0.8, 0.5]], [[0.1, 0.1], [0.3, 0.1]]])
    matcher = CtrlPointHungarianMatcher(class_weight=2.0, coord_weight=5.0)
    (q, w), = matcher(outputs, [{"ctrl_points": words, "labels": torch.zeros(2, dtype=torch.long)}])
    assert dict(zip(q.tolist(), w.tolist())) == {0: 1, 1: 0}
    # by hand: 2 x the class term (every query alike at p = 0.5) + 5 x the L1 distance of the points
    cls = 2.0 * (P_HALF_POS - P_HALF_NEG)
    expected = [[cls + 5 * (0.4 + 0.4 + 0.5 + 0.4), cls + 5 * 0.0],
                [cls + 5 * 0.1, cls + 5 * (0.4 + 0.4 + 0.6 + 0.4)],
                [cls + 5 * (0.5 + 0.5 + 0.8 + 0.5), cls + 5 * (0.1 + 0.1 + 0.3 + 0.1)]]
    (cost,) = matcher.costs(outputs, [{"ctrl_points": words, "labels": torch.zeros(2, dtype=torch.long)}])
    np.testing.assert_allclose(cost.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_reference_cost_matches_a_query_to_the_word_its_text_branch_samples():
    """Query 1's points lie on word 0, but its reference box sits on word 1 and query 0's on word 0: upstream's
    cost (ref_weight 0) pairs query 1 with word 0; with the reference cost each query takes the word it samples."""
    points = torch.tensor([[[0.40, 0.40], [0.60, 0.40]],  # query 0: between the words
                           [[0.50, 0.30], [0.70, 0.30]]])  # query 1: on word 0
    references = torch.tensor([[[0.60, 0.30, 0.2, 0.1],  # query 0's box: on word 0
                                [0.40, 0.60, 0.2, 0.1]]])  # query 1's box: on word 1
    words = {"ctrl_points": torch.tensor([[[0.50, 0.30], [0.70, 0.30]], [[0.30, 0.60], [0.50, 0.60]]]),
             "boxes": torch.tensor([[0.60, 0.30, 0.2, 0.05], [0.40, 0.60, 0.2, 0.05]]),
             "labels": torch.zeros(2, dtype=torch.long)}
    outputs = {"pred_logits": torch.zeros(1, 2, 2, 1), "pred_ctrl_points": points[None],
               "pred_references": references}
    (q, w), = CtrlPointHungarianMatcher(2.0, 5.0)(outputs, [words])
    assert dict(zip(q.tolist(), w.tolist())) == {0: 1, 1: 0}
    matcher = CtrlPointHungarianMatcher(2.0, 5.0, ref_weight=50.0)
    (q, w), = matcher(outputs, [words])
    assert dict(zip(q.tolist(), w.tolist())) == {0: 0, 1: 1}
    (with_refs,), (without,) = matcher.costs(outputs, [words]), CtrlPointHungarianMatcher(2.0, 5.0).costs(outputs,
                                                                                                          [words])
    # by hand: 50 x the L1 distance between the reference centre and the word box's centre
    np.testing.assert_allclose((with_refs - without).numpy(), 50 * np.array([[0.0, 0.5], [0.5, 0.0]]), atol=1e-5)


def test_the_model_hands_its_references_to_the_matcher_only_in_training():
    cfg = get_cfg()
    cfg.merge_from_file(str(Path(__file__).resolve().parent.parent / "third_party/testr/configs/micro.yaml"))
    cfg.MODEL.TRANSFORMER.LOSS.POINT_REF_WEIGHT = 50.0
    from detectron2.modeling import build_model
    from detectron2.structures import ImageList

    torch.manual_seed(0)
    model = build_model(cfg)
    assert model.criterion.point_matcher.ref_weight == 50.0
    images = ImageList.from_tensors([torch.randn(3, 64, 96)])
    model.train()
    out = model.testr(images)
    q = cfg.MODEL.TRANSFORMER.NUM_QUERIES
    assert out["pred_references"].shape == (1, q, 4) and out["pred_logits"].shape[1] == q
    model.eval()
    with torch.no_grad():
        assert "pred_references" not in model.testr(images)


def test_box_matcher_cost_is_class_l1_and_giou():
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.2], [0.25, 0.25, 0.1, 0.1], [0.8, 0.8, 0.1, 0.1]]])
    outputs = {"pred_logits": torch.zeros(1, 3, 1), "pred_boxes": boxes}
    words = torch.tensor([[0.8, 0.8, 0.2, 0.1], [0.5, 0.5, 0.2, 0.2]])
    targets = [{"boxes": words, "labels": torch.zeros(2, dtype=torch.long)}]
    (q, w), = BoxHungarianMatcher()(outputs, targets)
    assert dict(zip(q.tolist(), w.tolist())) == {0: 1, 2: 0}
    # proposal 2 vs word 0: L1 0.1 (width); boxes [0.75, 0.75, 0.85, 0.85] in [0.7, 0.75, 0.9, 0.85]: GIoU 0.5
    (cost,) = BoxHungarianMatcher(class_weight=2.0, coord_weight=5.0, giou_weight=2.0).costs(outputs, targets)
    cls = 2.0 * (P_HALF_POS - P_HALF_NEG)
    assert float(cost[2, 0]) == pytest.approx(cls + 5 * 0.1 - 2 * 0.5, rel=1e-5)
    assert float(cost[0, 1]) == pytest.approx(cls + 0.0 - 2 * 1.0, rel=1e-5)


def criterion():
    cfg = get_cfg()
    cfg.MODEL.TRANSFORMER.LOSS.AUX_LOSS = False
    return SetCriterion(cfg.MODEL.TRANSFORMER.LOSS, voc_size=96)


def test_each_loss_against_its_value_by_hand():
    # one picture, one word; two queries of two points, zero logits (p = 0.5), query 0 lies on the word
    word = {"labels": torch.zeros(1, dtype=torch.long), "ctrl_points": torch.tensor([[[0.2, 0.2], [0.6, 0.2]]]),
            "boxes": torch.tensor([[0.4, 0.2, 0.4, 0.1]]), "texts": torch.full((1, 25), 96, dtype=torch.long)}
    outputs = {"pred_logits": torch.zeros(1, 2, 2, 1),
               "pred_ctrl_points": torch.tensor([[[[0.25, 0.2], [0.6, 0.1]], [[0.9, 0.9], [0.9, 0.9]]]]),
               "pred_texts": torch.zeros(1, 2, 25, 97),
               "enc_outputs": {"pred_logits": torch.zeros(1, 3, 1),
                               "pred_boxes": torch.tensor([[[0.4, 0.2, 0.2, 0.1], [0.9, 0.9, 0.1, 0.1],
                                                            [0.1, 0.9, 0.1, 0.1]]])}}
    losses = criterion()(outputs, [word])
    assert losses["loss_ce"].item() == pytest.approx(P_HALF_POS + P_HALF_NEG, rel=1e-5)  # points averaged
    assert losses["loss_ctrl_points"].item() == pytest.approx(0.05 + 0.1, rel=1e-5)
    assert losses["loss_texts"].item() == pytest.approx(math.log(97), rel=1e-5)  # uniform over 97 classes
    assert losses["loss_enc_ce"].item() == pytest.approx(P_HALF_POS + 2 * P_HALF_NEG, rel=1e-5)
    assert losses["loss_enc_bbox"].item() == pytest.approx(0.2, rel=1e-5)  # width 0.2 vs 0.4
    # boxes [0.3, 0.15, 0.5, 0.25] inside [0.2, 0.15, 0.6, 0.25]: IoU 0.5, the hull is the word's box: GIoU loss 0.5
    assert losses["loss_enc_giou"].item() == pytest.approx(0.5, rel=1e-5)
    weighted = {k: v * criterion().weight(k) for k, v in losses.items()}
    assert weighted["loss_ctrl_points"].item() == pytest.approx(5.0 * 0.15, rel=1e-5)


def test_auxiliary_losses_for_every_earlier_decoder_layer():
    cfg = get_cfg()
    full = SetCriterion(cfg.MODEL.TRANSFORMER.LOSS, voc_size=96)
    layer = {"pred_logits": torch.zeros(1, 2, 2, 1), "pred_ctrl_points": torch.rand(1, 2, 2, 2),
             "pred_texts": torch.zeros(1, 2, 25, 97)}
    word = {"labels": torch.zeros(1, dtype=torch.long), "ctrl_points": torch.rand(1, 2, 2),
            "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]]), "texts": torch.zeros(1, 25, dtype=torch.long)}
    losses = full(dict(layer, aux_outputs=[layer, layer]), [word])
    assert {"loss_ce_0", "loss_ce_1", "loss_texts_1"} <= losses.keys()
    assert losses["loss_ctrl_points_1"].item() == pytest.approx(losses["loss_ctrl_points"].item())
    assert full.weight("loss_texts_1") == full.weight("loss_texts") == 2.0


def tiny_batch(h=160, w=192):
    from detectron2.structures import Boxes, Instances

    gen = torch.Generator().manual_seed(0)
    inst = Instances((h, w))
    boxes = torch.tensor([[10.0, 12, 90, 40], [60, 80, 170, 120]])
    inst.gt_boxes, inst.gt_classes = Boxes(boxes), torch.zeros(2, dtype=torch.int64)
    t = torch.linspace(0, 1, 8)
    inst.polygons = torch.stack([torch.cat([torch.stack([x0 + t * (x1 - x0), y0 + 0 * t], 1),
                                            torch.stack([x1 - t * (x1 - x0), y1 + 0 * t], 1)]).flatten()
                                 for x0, y0, x1, y1 in boxes.tolist()])
    inst.text = torch.randint(0, 97, (2, 25), generator=gen, dtype=torch.int32)
    return [{"image": torch.rand(3, h, w, generator=gen) * 255, "instances": inst}]


def test_three_steps_on_one_batch_lower_the_loss(monkeypatch):
    from detectron2.modeling import build_model
    from testr.layers import ms_deform_attn
    from testr.train import build_optimizer, train_step

    from d2export.patching.compiled_ops import make_stand_in

    monkeypatch.setattr(ms_deform_attn, "_C", make_stand_in("testr._C"))  # the op with a backward
    torch.manual_seed(0)
    cfg = get_cfg()
    cfg.merge_from_file(str(CONFIGS / "micro.yaml"))
    cfg.MODEL.TRANSFORMER.ENC_LAYERS = cfg.MODEL.TRANSFORMER.DEC_LAYERS = 1
    cfg.SOLVER.BASE_LR = cfg.SOLVER.LR_BACKBONE = 1e-3
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model)
    batch = tiny_batch()
    totals = [train_step(model, optimizer, batch, clip=0.1)["total"] for _ in range(4)]
    assert totals[3] < totals[0], totals  # the loss before each of steps 1..3, then after the third


def test_r50_trainer_checkpoint_loads_strictly_with_upstream_keys(tmp_path):
    from detectron2.modeling import build_model
    from testr.train import build_optimizer, load_checkpoint, save_checkpoint

    cfg = get_cfg()
    cfg.merge_from_file(str(CONFIGS / "TotalText" / "TESTR_R_50_Polygon.yaml"))
    cfg.MODEL.DEVICE = "cpu"
    torch.manual_seed(1)
    model = build_model(cfg)
    save_checkpoint(tmp_path / "last.pth", model, build_optimizer(cfg, model), iteration=7)
    rows = [line.split("\t") for line in (DATA / "testr_state_dict.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    state = torch.load(tmp_path / "last.pth", map_location="cpu", weights_only=False)["model"]
    assert [(k, list(v.shape)) for k, v in state.items()] == [(name, eval(shape)) for name, shape, _ in rows]
    torch.manual_seed(2)
    other = build_model(cfg)
    assert load_checkpoint(tmp_path / "last.pth", other) == 7
    for (k, a), b in zip(state.items(), other.state_dict().values()):
        assert torch.equal(a, b), k


def test_targets_keep_the_characters_a_model_with_fewer_text_queries_reads():
    """The sets store 25 character slots; micro.yaml reads 8: its targets are the first 8, in order."""
    from detectron2.modeling import build_model

    cfg = get_cfg()
    cfg.merge_from_file(str(CONFIGS / "micro.yaml"))
    assert cfg.MODEL.TRANSFORMER.NUM_CHARS == 8
    batch = tiny_batch()
    (target,) = build_model(cfg).prepare_targets([batch[0]["instances"]])
    assert torch.equal(target["texts"], batch[0]["instances"].text[:, :8])


# The scripts' tiny pictures (--size 128x160) read at their own size: micro.yaml's sizes would scale them up to 288-352
# first, six times the pixels, for a test of the script's plumbing
AT_THEIR_SIZE = ["INPUT.MIN_SIZE_TRAIN", "(128,)", "INPUT.MAX_SIZE_TRAIN", "160", "INPUT.MIN_SIZE_TEST", "128",
                 "INPUT.MAX_SIZE_TEST", "160"]


def test_the_script_resumes_at_its_iteration_and_learning_rate(tmp_path):
    """training/train_spotter.py stopped after 2 steps and run again goes on at step 3 with the warm-up's learning rate
    of step 3 (detectron2's linear warm-up from WARMUP_FACTOR over WARMUP_ITERS, computed here by hand)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    small = ["--train-count", "2", "--eval-count", "1", "--eval-every", "100", "--size", "128x160", *AT_THEIR_SIZE,
             "MODEL.TRANSFORMER.ENC_LAYERS", "1", "MODEL.TRANSFORMER.DEC_LAYERS", "1"]
    for iters in ("2", "3"):
        subprocess.run([sys.executable, str(repo / "training" / "train_spotter.py"), "--out", str(tmp_path), "--iters",
                        iters, *small], check=True, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["total"]) for r in rows)
    cfg = get_cfg()
    cfg.merge_from_file(str(CONFIGS / "micro.yaml"))
    s = cfg.SOLVER
    for r in rows:  # the rate of iteration t (0-based) while t < WARMUP_ITERS
        t = r["iter"] - 1
        assert r["lr"] == pytest.approx(s.BASE_LR * (s.WARMUP_FACTOR * (1 - t / s.WARMUP_ITERS) + t / s.WARMUP_ITERS))
    assert (tmp_path / "model_000003_fp16.pth").is_file() and "eval" in rows[-1]

    # done: --fixture trains no further, scores the float16 weights on another seed and writes them with a record
    fixture = tmp_path / "fixture" / "spotter.pth"
    subprocess.run([sys.executable, str(repo / "training" / "train_spotter.py"), "--out", str(tmp_path), "--iters", "3",
                    "--fixture", str(fixture), "--final-count", "2", "--final-seed", "5", *small], check=True,
                   capture_output=True, timeout=300)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    record = json.loads(fixture.with_suffix(".json").read_text())
    assert fixture.read_bytes() == (tmp_path / "model_000003_fp16.pth").read_bytes()
    assert record["sha256"] == hashlib.sha256(fixture.read_bytes()).hexdigest()
    assert record["held_out"]["seed"] == 5 and record["held_out"]["count"] == 2 and "det_hmean" in record["held_out"]
    assert [r["iter"] for r in record["curve"]] == [2, 3]  # each run's last step is evaluated
    # two runs of the script on one clock: the second goes on from the first's checkpoint
    assert rows[0]["seconds"] <= rows[1]["seconds"] <= rows[2]["seconds"] == pytest.approx(record["train_seconds"], abs=0.5)
    assert "--fixture" in record["command"] and "threads" in record["machine"]

    # a later session warm-starts from the committed weights: one step at the warm-up's 1e-6 leaves them almost
    # as they were, where another seed's fresh weights differ everywhere
    import torch

    warm = tmp_path / "warm"
    start = torch.load(fixture, weights_only=False)["model"]
    first_sha = record["sha256"]
    subprocess.run([sys.executable, str(repo / "training" / "train_spotter.py"), "--out", str(warm), "--iters", "1",
                    "--seed", "1", "--init", str(fixture), "--fixture", str(fixture), "--final-count", "2",
                    "--final-seed", "5", *small], check=True, capture_output=True, timeout=300)
    after = torch.load(warm / "model_000001_fp16.pth", weights_only=False)["model"]
    name = "testr.transformer.encoder.layers.0.linear1.weight"
    assert (after[name].float() - start[name].float()).abs().max() < 1e-2
    assert float(start[name].float().std()) > 1e-2  # a seed's weights, which another seed's would not match
    # the new fixture replaced the one it began from, whose record lives on inside the new one
    lineage = json.loads(fixture.with_suffix(".json").read_text())["init"]
    assert lineage["sha256"] == first_sha != hashlib.sha256(fixture.read_bytes()).hexdigest()
    assert lineage["record"]["iterations"] == 3 and "--iters 3" in lineage["record"]["command"]


def test_the_evaluation_reports_every_swept_threshold_from_one_run():
    """training/common.py's evaluate: a model with its own threshold at 0.3 finds the picture's two words (0.9, 0.5)
    and a stray (0.4). By hand: at 0.3 precision 2/3, recall 1, H-mean 80; from 0.45 on, the stray is gone (H-mean
    100); from 0.55 on, one word is lost (precision 1, recall 1/2: H-mean 66.67). The model runs once, at the lowest
    threshold, and keeps its own afterwards."""
    import sys

    from detectron2.data import DatasetCatalog
    from detectron2.structures import Instances

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # training/: the fixtures' workshop
    from training import common

    def square(x, y, side=40):
        return [x, y, x + side, y, x + side, y + side, x, y + side]

    words = [square(10, 10), square(100, 60)]
    DatasetCatalog.register("sweep_case", lambda: [{"image_id": 7, "annotations": [{"polygons": w} for w in words]}])

    class Model(torch.nn.Module):
        test_score_threshold, calls = 0.3, []

        def forward(self, batch):
            self.calls.append(self.test_score_threshold)
            found = Instances((200, 200), scores=torch.tensor([0.9, 0.5, 0.4]),
                              polygons=torch.tensor([words[0], words[1], square(150, 150)], dtype=torch.float32))
            return [{"instances": found[found.scores >= self.test_score_threshold]}]

    model = Model()
    try:
        own, sweep = common.evaluate(model, DatasetCatalog.get("sweep_case"), lambda r: r, "sweep_case", {})
    finally:
        DatasetCatalog.remove("sweep_case")
    assert own["det_precision"] == pytest.approx(200 / 3) and own["det_recall"] == 100
    assert sweep == pytest.approx({"0.2": 80, "0.25": 80, "0.3": 80, "0.35": 80, "0.4": 80, "0.45": 100, "0.5": 100,
                                   "0.55": 200 / 3, "0.6": 200 / 3})
    assert model.calls == [min(common.SWEEP)] and model.test_score_threshold == 0.3 and model.training


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda trains instead of refusing")
def test_train_spotter_refuses_a_device_torch_does_not_see():
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    for device, says in (("cuda", "--device cuda: torch .* sees 0 CUDA device"),
                         ("gpu", "--device gpu: choose cpu, auto, cuda or cuda:N")):
        done = subprocess.run([sys.executable, str(repo / "training" / "train_spotter.py"), "--device", device, "--out",
                               "/nonexistent/never_made"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and re.search(says, done.stderr), done.stderr


def test_the_glyph_loss_resumes_with_its_classifier_and_a_run_without_it_is_refused(tmp_path):
    """training/train_spotter.py --glyph-weight logs the glyph loss every step, keeps its classifier in last.pth and
    goes on from it; resuming such a run without the flag (its optimizer holds the classifier's group) is refused in
    one line, and the float16 weights have no classifier (what serves has none)."""
    import json
    import subprocess
    import sys

    import torch

    repo = Path(__file__).resolve().parent.parent
    small = ["--out", str(tmp_path), "--train-count", "2", "--eval-count", "1", "--eval-every", "100", "--size",
             "128x160", "MODEL.TRANSFORMER.ENC_LAYERS", "1", "MODEL.TRANSFORMER.DEC_LAYERS", "1"]
    script = str(repo / "training" / "train_spotter.py")
    for iters in ("1", "2"):
        subprocess.run([sys.executable, script, "--iters", iters, "--glyph-weight", "1", *small], check=True,
                       capture_output=True, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows] == [1, 2] and all(r["loss_glyphs"] > 0 for r in rows)
    assert set(torch.load(tmp_path / "last.pth", weights_only=False)["glyph_head"]) == {"weight", "bias"}
    weights = torch.load(tmp_path / "model_000002_fp16.pth", weights_only=False)["model"]
    assert not any("glyph" in k or "char_centre" in k for k in weights)
    done = subprocess.run([sys.executable, script, "--iters", "3", *small], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "was trained with --glyph-weight" in done.stderr, done.stderr


def test_training_the_text_branch_alone_leaves_detection_as_it_was(tmp_path):
    """training/train_spotter.py --train text: from given weights, two steps move the text branch's parameters and not
    one number of the rest (weights and BatchNorm statistics: detection is exactly --init's); resuming such a run as
    a whole-model one is refused in one line, and the glyph loss (it trains the features) is refused with it."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    script = str(repo / "training" / "train_spotter.py")
    small = ["--train-count", "2", "--eval-count", "1", "--eval-every", "100", "--size", "128x160", *AT_THEIR_SIZE,
             "SOLVER.WARMUP_FACTOR", "1.0", "MODEL.TRANSFORMER.ENC_LAYERS", "1", "MODEL.TRANSFORMER.DEC_LAYERS", "1"]
    start = tmp_path / "start"
    subprocess.run([sys.executable, script, "--out", str(start), "--iters", "1", *small], check=True,
                   capture_output=True, timeout=300)
    init = start / "model_000001_fp16.pth"
    text = tmp_path / "text"
    subprocess.run([sys.executable, script, "--out", str(text), "--iters", "2", "--train", "text", "--init", str(init),
                    *small], check=True, capture_output=True, timeout=300)
    before = torch.load(init, weights_only=False)["model"]
    after = torch.load(text / "last.pth", weights_only=False)["model"]
    assert set(before) == set(after)
    moved = {k for k in before if not torch.equal(before[k].float(), after[k].float())}
    texts = {k for k in before if "text" in k and before[k].is_floating_point()}
    assert any(k.startswith("testr.transformer.decoder.") for k in moved) and "testr.text_class.weight" in moved
    assert moved <= texts  # nothing else moved, not even a running mean
    assert any("running_mean" in k for k in before)  # the BatchNorms' statistics were compared

    resumed = subprocess.run([sys.executable, script, "--out", str(text), "--iters", "3", *small],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 2 and "was trained with --train text" in resumed.stderr, resumed.stderr
    glyphs = subprocess.run([sys.executable, script, "--out", str(tmp_path / "g"), "--iters", "1", "--train", "text",
                             "--glyph-weight", "1", *small], capture_output=True, text=True, timeout=300)
    assert glyphs.returncode == 2 and "--glyph-weight" in glyphs.stderr, glyphs.stderr
