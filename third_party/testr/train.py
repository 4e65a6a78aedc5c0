"""Training TESTR: the optimizer with upstream's parameter groups, one step with gradient clipping, and checkpoints
(a resumable one with the optimizer, and light float16 snapshots of the weights)."""
import os
from pathlib import Path

import torch


def parameter_groups(cfg, model):
    """AdamW groups as TESTR's trainer makes them: the backbone at LR_BACKBONE, the attention's sampling offsets and
    reference points at BASE_LR * LR_LINEAR_PROJ_MULT, the rest at BASE_LR; with LR_TEXT_MULT other than 1 (not
    upstream), the text branch's other parameters at BASE_LR * LR_TEXT_MULT."""
    s = cfg.SOLVER
    text = s.LR_TEXT_MULT != 1.0
    groups = {"backbone": [], "linear_proj": [], "text": [], "rest": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if any(k in name for k in s.LR_BACKBONE_NAMES):
            groups["backbone"].append(p)
        elif any(k in name for k in s.LR_LINEAR_PROJ_NAMES):
            groups["linear_proj"].append(p)
        elif text and "text" in name:
            groups["text"].append(p)
        else:
            groups["rest"].append(p)
    lrs = {"backbone": s.LR_BACKBONE, "linear_proj": s.BASE_LR * s.LR_LINEAR_PROJ_MULT,
           "text": s.BASE_LR * s.LR_TEXT_MULT, "rest": s.BASE_LR}
    return [{"params": ps, "lr": lrs[k], "name": k} for k, ps in groups.items() if ps]


def build_optimizer(cfg, model):
    return torch.optim.AdamW(parameter_groups(cfg, model), lr=cfg.SOLVER.BASE_LR,
                             weight_decay=cfg.SOLVER.WEIGHT_DECAY)


def train_step(model, optimizer, batch, clip=0.1):
    """One step on a batch of mapped records; returns the weighted losses and their total as floats."""
    model.train()
    losses = model(batch)
    total = sum(losses.values())
    optimizer.zero_grad(set_to_none=True)
    total.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return {"total": float(total.detach()), **{k: float(v.detach()) for k, v in losses.items()}}


def _atomic_save(obj, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(path, model, optimizer=None, iteration=0, **extra):
    """detectron2's checkpoint layout ({"model": state dict, …}): loads with DetectionCheckpointer or
    load_checkpoint; with the optimizer and iteration, training resumes from it."""
    state = {"model": model.state_dict(), "iteration": iteration, **extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    _atomic_save(state, path)


def save_weights_fp16(path, model, iteration=0):
    """The weights alone in float16 (half the size; loading copies them into the float32 model), on the CPU
    whatever device trained them; without the training-only character-centre classifier (what serves has none)."""
    state = {k: (v.half() if v.is_floating_point() else v).cpu() for k, v in model.state_dict().items()
             if not k.startswith("char_centre_class.")}
    _atomic_save({"model": state, "iteration": iteration}, path)


def load_checkpoint(path, model, optimizer=None):
    """Loads strictly, but for BatchNorm's step counters (weights trained with frozen norms, which FrozenBatchNorm2d
    has none of, warm-start a model whose norms train) and the training-only character-centre classifier (a run that
    adds it starts it fresh). Returns the iteration it was written at."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked") and not k.startswith("char_centre_class.")]
    if missing or unexpected:
        raise RuntimeError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    return int(state.get("iteration", 0))
