"""How the fused MSDA operator's CPU library is compiled, in one place: setup.py builds the installed library with
these flags, and the tests and `tools/benchmark.py native` build it for each x86-64 level to check, on whatever CPU
they run on, that every build computes the same bits.

Why it computes the same bits everywhere: the kernel's row code is cloned for AVX-512, x86-64-v3 (AVX2 + FMA) and
the x86-64 baseline (target_clones in msda_op.cc), and one clone is picked when the library loads. GCC contracts
`a * b + c` into a fused multiply-add by default wherever the target has FMA, which rounds once instead of twice: the
same library returned other bits on an AVX-512 CPU than on an AVX2 one. So the sampling header writes its
multiply-adds out (fma, fmaf: correctly rounded on every target, an instruction where there is FMA, glibc's
function on the baseline) and the compiler contracts nothing else (-ffp-contract=off here, nvcc -fmad=false for the
CUDA kernel). The flags are recorded in the library (-frecord-gcc-switches) so a test can read what built it.
Measured side by side (`tools/benchmark.py native`, AVX-512 + AMX Xeon): the explicit multiply-adds run as fast as
GCC's contraction did; without any multiply-add the encoder call was ~6% slower.

Standard library only: setup.py loads this file by path before d2export is installed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

NATIVE = Path(__file__).resolve().parent / "native"
SOURCE = NATIVE / "msda_op.cc"
NATIVE_FLAGS = (["/O2", "/std:c++17", "/fp:precise"] if os.name == "nt"
                else ["-O3", "-g0", "-std=c++17", "-fvisibility=hidden", "-pthread", "-ffp-contract=off", "-fno-wrapv",
                      "-frecord-gcc-switches"])
# x86-64 micro-architecture levels (-march=...) each clone of the row code stands for, and the CPU flags
# (/proc/cpuinfo) a CPU needs to run a build for that level.
LEVELS = {
    "x86-64": (),
    "x86-64-v3": ("avx2", "fma", "bmi2"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
}
# fused multiply-add instructions (FMA3, FMA4, AVX-512), as objdump spells them
FMA = re.compile(r"\bv?f(n?)m(add|sub|addsub|subadd)(132|213|231)?[ps][sdh]\b")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def build(output: Path, level: str | None = None, contract: bool = False) -> Path:
    """msda_op.cc compiled to the shared library `output` with setup.py's flags. `level` (a key of LEVELS): one build
    for that x86-64 level alone, target clones off (what the clone for it computes, on a CPU that can run it; None:
    the clones as installed). `contract`: let the compiler fuse multiply-adds (the build setup.py does not make, for
    measuring it and for proving that the checks below can tell it apart)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) to build the MSDA library")
    flags = [f for f in NATIVE_FLAGS if not (contract and f.startswith("-ffp-contract"))]
    if contract:
        flags.append("-ffp-contract=fast")
    if level is not None:
        flags += [f"-march={level}", "-DD2_NO_CLONES=1"]
    output.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([cxx, *flags, "-shared", "-fPIC", f"-I{NATIVE}", str(SOURCE), "-o", str(output)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building {output.name} failed:\n{done.stderr[-3000:]}")
    return output


OPENVINO_SOURCE = NATIVE / "msda_openvino.cc"


def build_openvino(output: Path, openvino_dir: Path) -> Path:
    """msda_openvino.cc (the fused operator as an OpenVINO extension, the rows of msda_rows.h) compiled with the
    flags above against the OpenVINO package at `openvino_dir` (its include/ and libs/, as the pip wheel lays them
    out), to the shared library `output`."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) to build the MSDA extension for OpenVINO")
    libs = openvino_dir / "libs"
    runtime = sorted(libs.glob("libopenvino.so*"), key=lambda p: len(p.name))
    tbb = sorted(libs.glob("libtbb.so*"), key=lambda p: len(p.name))
    if not (openvino_dir / "include").is_dir() or not runtime or not tbb:
        raise RuntimeError(f"{openvino_dir} has no include/ or no libopenvino/libtbb in libs/: an OpenVINO without "
                           "its development files")
    output.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([cxx, *NATIVE_FLAGS, "-shared", "-fPIC", f"-I{NATIVE}", f"-I{openvino_dir / 'include'}",
                           str(OPENVINO_SOURCE), "-o", str(output), f"-L{libs}", f"-l:{runtime[-1].name}",
                           f"-l:{tbb[-1].name}", f"-Wl,-rpath,{libs}"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building {output.name} failed:\n{done.stderr[-3000:]}")
    return output


def disassembly(library: str | Path) -> dict[str, str]:
    """`library`'s machine code by function (objdump -d, names demangled, clones named '<name> [clone .<target>]')."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise RuntimeError("no objdump (binutils) to read the library's machine code")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True,
                             text=True, check=True).stdout
    found = {}
    for block in listing.split("\n\n"):
        if m := re.match(r"[0-9a-f]+ <(.+)>:\n", block.strip() + "\n"):
            found[m.group(1)] = block
    return found


def recorded_switches(library: str | Path) -> str:
    """The compiler command lines recorded in `library` (the .GCC.command.line section -frecord-gcc-switches
    writes; GCC and clang), or "" where none was recorded."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise RuntimeError("no readelf (binutils) to read the library's sections")
    done = subprocess.run([readelf, "-p", ".GCC.command.line", str(library)], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


def contracts(switches: str) -> bool:
    """Whether recorded command lines let the compiler contract multiply-adds (or reorder float arithmetic at
    all): any line without -ffp-contract=off, or with fast-math."""
    lines = [ln for ln in switches.splitlines() if ln.strip().startswith("[")]
    return not lines or any("-ffp-contract=off" not in ln or "fast-math" in ln or "-Ofast" in ln for ln in lines)


def runnable_levels() -> list[str]:
    """The LEVELS this CPU can run."""
    from d2export.cpu import first_processor  # not at the top: setup.py loads this file before d2export is installed

    flags = set(first_processor().get("flags", "").split())
    return [level for level, needs in LEVELS.items() if set(needs) <= flags]
