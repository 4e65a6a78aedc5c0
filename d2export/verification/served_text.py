"""What a text spotter serves, held to the model's own code: the words and scores the runtime reads from the
exported graph (the manifest's charset and decoding, d2export.runtime's post-processing) against the unedited
model's own forward (its `inference()`: scores, per-slot ids) read by its own visualizer
(`<package>.utils.visualizer.TextVisualizer`, the class its demo draws words with).

The graph's tensors are verified elsewhere (character ids, not words); a wrong dictionary, an index shifted by one
or a wrong CTC rule passes that and is refused here. Every query is compared (the model's threshold set to 0 for the
call), query by query, on the verification's first sizes:
- reading: the model's own ids read by its visualizer equal the same ids read by the manifest's charset and rule —
  exact, for every instance (no float in it);
- served: the served word equals the model's own word, except where the graph's id differs at a slot whose two
  probabilities are a float tie in the model's own `rec_scores` (within TIE); the score within SCORE_ATOL.
Where the model's package has no visualizer to read with, the manifest says the words were not checked, and why;
the scores are compared all the same, and for spotters that read no text (DPText-DETR, SRFormer) they are all there is.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np

from d2export.verification.comparison import VerificationError
from d2export.families._text import own_visualizer

log = logging.getLogger("d2export")

SCORE_ATOL = 1e-4  # issue 92's bound for served scores against the model's own
TIE = 1e-4  # two characters' probabilities this close are a float tie: either id is the model's answer
THRESHOLD_ATTRS = ("test_score_threshold",)  # where AdelaiDet-lineage detectors keep INFERENCE_TH_TEST


class ServedTextError(VerificationError):
    """The served words or scores are not the model's own."""


def own_reader(model, d2cfg, ctc: bool, search=()) -> tuple[object | None, str]:
    """The model's own id → word function (its visualizer's decoding method) and where it lives, or (None, why)."""
    method = "_ctc_decode_recognition" if ctc else "_decode_recognition"
    made, where = own_visualizer(model, d2cfg, search)
    if made is None:
        return None, where
    if not hasattr(made, method):
        return None, f"{where} has no {method}"
    return getattr(made, method), f"{where}.{method}"


@contextlib.contextmanager
def threshold_zero(model):
    """Every query through the model's own inference(): its score threshold at 0 for the block (None where the
    model keeps it elsewhere: then its own threshold stays, and the served side uses the same)."""
    name = next((a for a in THRESHOLD_ATTRS if isinstance(getattr(model, a, None), (int, float))), None)
    if name is None:
        yield None
        return
    kept = getattr(model, name)
    setattr(model, name, 0.0)
    try:
        yield 0.0
    finally:
        setattr(model, name, kept)


def check(built, model_path: Path, manifest, pictures) -> dict:
    """The manifest's record of the served words against the model's own; raises ServedTextError where they
    differ. `pictures`: CHW uint8 pictures in the model's pixel format, each served alone at its own size (the
    verification's, whose graph outputs matched eager's without near-tied picks imposed: a TopK tie between two
    proposals would change whole instances, which the tensors' verification judges, not this)."""
    import torch

    from d2export.charset import decode
    from d2export.verification import check_sessions
    from d2export.runtime.processing import Prepared, Processing

    post = manifest.postprocess
    if built.family.evaluator != "text":
        return {}
    exact = manifest.precision == "float32"
    ctc = post.get("text_decoding") == "ctc"
    reader, where = None, "the model reads no text"
    reads = "charset" in post or "charsets" in post  # one set, or one per script (DeepSolo++)
    if reads:
        # which of its visualizer's readings the model's config asks for (DeepSolo: CTC; TESTR: TEXT_CTC), taken
        # from that config, not from the manifest under check
        own_ctc = built.family.postprocess(built.d2cfg).get("text_decoding") == "ctc"
        reader, where = own_reader(built.model, built.d2cfg, own_ctc, built.model_folders)
        if reader is None:
            log.warning("served words not checked against the model's own reading: %s", where)
    charsets = post.get("charsets") or {None: post.get("charset", "")}
    processing = Processing(manifest)
    session = check_sessions.session(model_path, built.cfg.verify.providers)
    words = ties = instances = 0
    worst = 0.0
    problems: list[str] = []
    with threshold_zero(built.model) as threshold, torch.no_grad():
        for chw in pictures:
            h, w = chw.shape[-2:]
            prepared = Prepared(chw, h, w)
            own = built.model([{"image": torch.from_numpy(chw).to(built.device), "height": h, "width": w}])
            own = own[0]["instances"].to("cpu")
            outputs = dict(zip(processing.output_names, session.run(processing.output_names,
                                                                     processing.feeds([prepared]))))
            served = processing.postprocess(outputs, 0, prepared,
                                            threshold if threshold is not None else None).instances
            if len(served) != len(own) and exact:
                problems.append(f"{h}x{w}: {len(served)} instances served, the model returns {len(own)}")
                continue
            instances += len(served)
            worst = max([worst] + [abs(i.score - s) for i, s in zip(served, own.scores.tolist())])
            if reader is None:
                continue
            probs = own.rec_scores.float().numpy() if own.has("rec_scores") else None
            scripts = ([post["languages"][i] for i in own.languages.tolist()] if own.has("languages")
                       else [None] * len(own))
            for k, (inst, ids, script) in enumerate(zip(served, own.recs.tolist(), scripts)):
                own_word = reader(ids) if script is None else reader(ids, script)
                ours = decode(ids, list(charsets[script]), ctc=ctc, unknown=post.get("unknown_id"))
                if inst.language != script:
                    problems.append(f"{h}x{w} query {k}: served in {inst.language}, the model reads {script}")
                words += 1
                if ours != own_word:
                    problems.append(f"{h}x{w} query {k}: the model's own ids read {own_word!r} by its visualizer, "
                                    f"{ours!r} by the manifest's charset and decoding")
                elif inst.text != own_word:
                    served_ids = outputs["char_ids"][0, k].tolist()
                    if probs is not None and _tied(probs[k], ids, served_ids):
                        ties += 1
                    else:
                        problems.append(f"{h}x{w} query {k}: served {inst.text!r}, the model reads {own_word!r}")
    record = {"checked": True, "instances": instances, "max_score_error": float(worst), "score_atol": SCORE_ATOL}
    if reader is not None:
        record |= {"reader": where, "words": words, "near_ties": ties}
    elif reads:
        record |= {"words": f"not checked: {where}"}
    if not exact:  # the words and scores of a reduced precision are its own verification's (its tolerances)
        problems = [p for p in problems if "by the manifest's charset" in p]
        record = {k: v for k, v in record.items() if k in ("checked", "reader", "words")} | {
            "served_compared": f"no: a {manifest.precision} graph's characters and scores are held to its own "
                               "verification's tolerances; its reading rule is checked here"}
    elif worst > SCORE_ATOL:
        problems.append(f"served scores up to {worst:.2e} from the model's own (bound {SCORE_ATOL:g})")
    if problems:
        more = f"\n  … and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ServedTextError(f"what is served is not what the model returns ({len(problems)} problem(s); "
                              f"{where}):\n  " + "\n  ".join(problems[:8]) + more)
    log.info("served: %d instances, scores within %.1e of the model's own; %s", instances, worst,
             f"{words} words equal its own reading ({where}), {ties} near ties" if reader else where)
    return record


def _tied(probs: np.ndarray, own_ids: list[int], served_ids: list[int]) -> bool:
    """Every slot where the ids differ is a float tie in the model's own probabilities."""
    return all(abs(float(p[a]) - float(p[b])) <= TIE for p, a, b in zip(probs, own_ids, served_ids) if a != b)
