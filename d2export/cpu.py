"""What CPU this is, in the words speed figures need: its model and the instruction sets int8, bfloat16 and float32
kernels depend on (torch-free; Linux reads /proc/cpuinfo, elsewhere the platform's name alone)."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Sequence

CPUINFO = Path("/proc/cpuinfo")
FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# int8 dot products summed into 32 bits; without one, x86 kernels multiply u8 by s8 with vpmaddubsw, whose pairs of
# products saturate 16 bits where weights pass ±64 (int8 graphs quantised for such a CPU keep 7 bits)
INT8_DOT_PRODUCT = ("avx512_vnni", "avx_vnni", "amx_int8")


def first_processor() -> dict[str, str]:
    """The first processor's /proc/cpuinfo fields by name ({} where there is none)."""
    try:
        block = CPUINFO.read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}


def cpu_features() -> list[str]:
    """Which of FEATURES the CPU has, in that order."""
    flags = set(first_processor().get("flags", "").split())
    return [f for f in FEATURES if f in flags]


def int8_pairs_saturate(features: Sequence[str] | None = None) -> bool:
    """Whether this x86 CPU (with `features`; None: its own) lacks an int8 dot product, so that u8s8 products of
    8-bit weights can saturate (elsewhere kernels do not pair products into 16 bits)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    return not set(cpu_features() if features is None else features) & set(INT8_DOT_PRODUCT)


def describe_cpu() -> str:
    """'<model>, <n> logical CPUs, <features>', e.g. 'AMD EPYC, 2 logical CPUs, avx2 avx512f avx512_vnni'."""
    model = first_processor().get("model name") or platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} logical CPUs, {' '.join(cpu_features()) or 'none of ' + '/'.join(FEATURES)}"
