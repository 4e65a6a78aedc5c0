"""What CPU this is, in the words speed figures need: its model and the instruction sets int8, bfloat16 and float32
kernels depend on (torch-free; Linux reads /proc/cpuinfo, elsewhere the platform's name alone)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


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


def describe_cpu() -> str:
    """'<model>, <n> logical CPUs, <features>', e.g. 'AMD EPYC, 2 logical CPUs, avx2 avx512f avx512_vnni'."""
    model = first_processor().get("model name") or platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} logical CPUs, {' '.join(cpu_features()) or 'none of ' + '/'.join(FEATURES)}"
