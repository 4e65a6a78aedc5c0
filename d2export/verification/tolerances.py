"""What a graph of a config is held to, read from its `verify.*` keys: float32's tolerances and each reduced
precision's."""
from __future__ import annotations

from d2export.config import D2ExportConfig
from d2export.verification import comparison

VERIFY_KEYS = {"float16": "fp16", "int8": "int8", "bfloat16": "bf16"}  # a reduced precision → the prefix of its verify.* tolerances


def float32_tolerances(cfg: D2ExportConfig) -> comparison.Float32:
    """What a float32 graph of this config is held to (`verify.atol`, `rtol`, `pixel_atol`, `max_mismatch`)."""
    v = cfg.verify
    return comparison.Float32(v.atol, v.rtol, v.pixel_atol, v.max_mismatch)


def reduced_tolerances(cfg: D2ExportConfig, precision: str = "float16") -> comparison.Reduced:
    """What a float16, int8 or bfloat16 graph of this config is held to (`verify.fp16_*`, `int8_*` or `bf16_*`,
    `verify.confident`, top-K)."""
    v, key = cfg.verify, VERIFY_KEYS[precision]
    tol = [getattr(v, f"{key}_{name}") for name in ("atol", "rtol", "pixel_atol", "pixel_rtol", "max_mismatch")]
    return comparison.Reduced(precision, *tol, v.confident, v.top_k, v.min_top_k_agreement)


def _reduced_settings(cfg: D2ExportConfig, precision: str) -> str:
    """The config keys behind a reduced precision's tolerances, for a refusal's message."""
    v, key = cfg.verify, VERIFY_KEYS[precision]
    return ", ".join(f"comparison.{key}_{n}={getattr(v, f'{key}_{n}')}" for n in ("atol", "rtol", "pixel_atol",
                                                                               "pixel_rtol"))
