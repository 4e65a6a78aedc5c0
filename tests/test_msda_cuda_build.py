"""The fused MSDA operator's CUDA build (d2export/kernels/native/msda_op_cuda.cu, built by setup.py where nvcc exists),
checked without a GPU: the library carries the kernel's machine code for every serving GPU (sm_75, sm_80, sm_86, sm_89,
sm_90) and sm_90 PTX, and needs nothing outside glibc, libstdc++ and libgcc at run time; the sampling header the CUDA
kernel computes with (msda_sample.h) matches a float64 reference on the CPU, through the CUDA kernel's own per-element
function compiled by the host compiler; and the library loads into a CPU-only onnxruntime (no GPU, no driver) and
serves the fused operator there exactly as the CPU-only library does."""
import ctypes
import importlib.util
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from d2export.kernels import custom_ops, native_build
from test_native_msda import CASES, _feed, _half_args, _inputs, _session, assert_close, half_model

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "d2export" / "kernels" / "native"
FATBIN_MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2  # a fatbin entry's kind
SERVING_SM = (75, 80, 86, 89, 90)  # setup.py's CUDA_SM: T4, A100/A30, A10/A40/RTX 30, L4/L40S/RTX 40, H100/H200
PTX_SM = 90  # the newest, which GPUs after it (Blackwell) compile at load
KERNEL = "msda_forward"  # msda_op_cuda.cu's __global__ template
# its instantiations, as mangled: <value/output, locations/weights, channels per thread (8: 16-byte loads; 1: scalar)>
INSTANTIATIONS = {"IffLi8E", "IffLi1E", "I6__halffLi8E", "I6__halffLi1E", "I6__halfS1_Li8E", "I6__halfS1_Li1E"}
# what the library may ask the dynamic loader for: glibc's own libraries, libstdc++ and libgcc (no libcudart, no
# libcuda: the driver is opened by the static cudart at run time, and only when a CUDA session runs the kernel)
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0", "libstdc++.so.6",
                  "libgcc_s.so.1", "ld-linux-x86-64.so.2"}
GLIBC_AT_MOST = (2, 34)  # docs/setup.md: the newest glibc symbol version the libraries use (measured 2.34)


@pytest.fixture(scope="module")
def cuda_library() -> str:
    """The built CUDA library. Skipped only where setup.py could not have built it (no nvcc); with nvcc, missing
    fails."""
    path = custom_ops.cuda_library()
    if path is None:
        if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").is_file():
            pytest.skip("no nvcc on this machine, so setup.py could not build the CUDA MSDA library")
        pytest.fail("nvcc exists but the CUDA MSDA library is not built (no d2export/kernels/_msda_cuda*.so): run "
                    "`pip install --no-deps --no-build-isolation -e .`, which builds it (D2EXPORT_CUDA unset)")
    return path


def _section(path: str, name: str) -> bytes:
    """An ELF64 little-endian section's bytes (b"" where there is none)."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for sh_name, _, _, _, offset, size, *_ in headers:
        end = data.index(b"\0", names_at + sh_name)
        if data[names_at + sh_name:end].decode() == name:
            return data[offset:offset + size]
    return b""


def fatbin_entries(path: str) -> set[tuple[int, int]]:
    """(kind, sm) of every image in the library's .nv_fatbin section: the containers nvcc writes (magic 0xBA55ED50,
    version, header size, size), each a run of entries (kind: 1 PTX, 2 cubin; header size; payload size; the SM
    version at byte 28). cuobjdump --list-elf/--list-ptx reads the same headers where it is installed."""
    blob, found, at = _section(path, ".nv_fatbin"), set(), 0
    while at + 16 <= len(blob):
        magic, _, header, size = struct.unpack_from("<IHHQ", blob, at)
        if magic != FATBIN_MAGIC:
            at += 8  # containers are 8-byte aligned
            continue
        entry, end = at + header, at + header + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", blob, entry)
            found.add((kind, struct.unpack_from("<I", blob, entry + 28)[0]))
            entry += entry_header + payload
        at = end
    return found


def cuobjdump() -> str | None:
    """The CUDA toolkit's cuobjdump, else the one triton carries (torch's dependency, so in the export venv)."""
    home = Path(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc").resolve().parent
    spec = importlib.util.find_spec("triton")
    triton = [Path(p) / "backends" / "nvidia" / "bin" / "cuobjdump" for p in (spec.submodule_search_locations or [])] \
        if spec else []
    candidates = [home / "cuobjdump", Path("/usr/local/cuda/bin/cuobjdump"), *triton]
    return shutil.which("cuobjdump") or next((str(p) for p in candidates if p.is_file()), None)


def sass_functions(library: str, tool: str) -> dict[int, set[str]]:
    """sm → the functions whose machine code the library holds for it (cuobjdump --dump-sass: 'code for sm_NN', then
    'Function : <mangled name>' per kernel). An image without functions (a link step's stub) counts for nothing."""
    listing = subprocess.run([tool, "--dump-sass", library], capture_output=True, text=True, check=True).stdout
    found: dict[int, set[str]] = {}
    sm = None
    for line in listing.splitlines():
        if m := re.match(r"\s*code for sm_(\d+)", line):
            sm = int(m.group(1))
            found.setdefault(sm, set())
        elif (m := re.match(r"\s*Function : (\S+)", line)) and sm is not None:
            found[sm].add(m.group(1))
    return found


def test_library_carries_machine_code_for_every_serving_gpu_and_ptx(cuda_library):
    sections = subprocess.run(["readelf", "-S", "-W", cuda_library], capture_output=True, text=True).stdout \
        if shutil.which("readelf") else ""
    assert ".nv_fatbin" in sections or not shutil.which("readelf"), sections[-2000:]
    entries = fatbin_entries(cuda_library)
    assert {(CUBIN, sm) for sm in SERVING_SM} | {(PTX, PTX_SM)} <= entries, sorted(entries)
    assert not {(PTX, sm) for sm in SERVING_SM if sm != PTX_SM} & entries, sorted(entries)  # one PTX, the newest


def test_every_architecture_holds_the_kernel_itself(cuda_library):
    """A cubin listed is not a kernel present (the link step leaves an sm_75 stub with no function in it): each
    architecture's machine code holds the kernel's six instantiations (three type variants, wide and scalar), and
    the PTX defines them too."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump here (the CUDA toolkit's or triton's)")
    functions = sass_functions(cuda_library, tool)
    kernels = {sm: {f for f in names if KERNEL in f} for sm, names in functions.items()}
    want = kernels.get(PTX_SM, set())
    found = {i for i in INSTANTIATIONS for f in want if f"{KERNEL}{i}" in f}
    assert len(want) == len(INSTANTIATIONS) and found == INSTANTIATIONS, functions
    assert {sm: kernels.get(sm) for sm in SERVING_SM} == {sm: want for sm in SERVING_SM}, sorted(functions)
    ptx = subprocess.run([tool, "--dump-ptx", cuda_library], capture_output=True, text=True, check=True).stdout
    assert f".target sm_{PTX_SM}" in ptx and all(f".entry {f}" in ptx for f in want), ptx[:2000]


def test_library_needs_only_glibc_libstdcxx_and_libgcc(cuda_library):
    if not shutil.which("readelf"):
        pytest.skip("no readelf")
    dynamic = subprocess.run(["readelf", "-d", "-W", cuda_library], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed and needed <= ALLOWED_NEEDED, sorted(needed)
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", cuda_library], capture_output=True, text=True,
                             check=True).stdout
    glibc = max(tuple(map(int, v.split("."))) for v in re.findall(r"@GLIBC_([\d.]+)", symbols))
    print(f"\n{Path(cuda_library).name}: NEEDED {sorted(needed)}; newest glibc symbol GLIBC_{'.'.join(map(str, glibc))}")
    assert glibc <= GLIBC_AT_MOST, glibc


def test_library_exports_only_registration_and_needs_no_cuda_library(cuda_library):
    """cudart is linked in statically and kept inside: the library needs no libcudart/libcuda to load, and exports
    RegisterCustomOps and no CUDA symbol that could stand in for the runtime onnxruntime's CUDA provider uses."""
    if not shutil.which("readelf"):
        pytest.skip("no readelf")
    dynamic = subprocess.run(["readelf", "-d", "-W", cuda_library], capture_output=True, text=True).stdout
    assert "libcudart" not in dynamic and "libcuda." not in dynamic, dynamic
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", cuda_library], capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines()
                if " GLOBAL " in line and " UND " not in line and "DEFAULT" in line}
    assert "RegisterCustomOps" in exported
    assert not [s for s in exported if s.startswith(("cuda", "__cuda", "cu"))], sorted(exported)


# --- the shared header on the CPU ------------------------------------------------------------------------------
_HARNESS = r"""
#include "msda_sample.h"
// The CUDA kernel's loop on the host: each "thread" (image, query, head, group of V channels) calls the same
// msda::accumulate the kernel calls, float16 carried as its bits and converted by the header's own functions.
template <int V, typename T, typename U>
void run(const T* value, const int64_t* shapes, const int64_t* starts, const U* loc, const U* attn, float* out,
         int64_t batch, int64_t tokens, int64_t heads, int64_t dim, int64_t queries, int levels, int64_t points) {
  msda::Levels table{};
  for (int lv = 0; lv < levels; ++lv) {
    table.height[lv] = shapes[2 * lv];
    table.width[lv] = shapes[2 * lv + 1];
    table.start[lv] = starts[lv];
  }
  auto widen = [](auto x) {
    if constexpr (sizeof(x) == 2) return msda::half_to_float(x); else return static_cast<float>(x);
  };
  auto load = [&](const T* p, float (&v)[V]) { for (int k = 0; k < V; ++k) v[k] = widen(p[k]); };
  const int64_t width_md = heads * dim, groups = dim / V, total = batch * queries * heads * groups;
  for (int64_t idx = 0; idx < total; ++idx) {
    const int64_t channel = (idx % groups) * V, row_head = idx / groups, h = row_head % heads, row = row_head / heads;
    const T* head = value + (row / queries) * tokens * width_md + h * dim + channel;
    float acc[V] = {};
    msda::accumulate<V>(head, loc, attn, table, levels, points, row_head, width_md, load, widen, acc);
    for (int k = 0; k < V; ++k) out[row_head * dim + channel + k] = acc[k];
  }
}

#define ENTRY(name, V, T, U)                                                                                       \
  extern "C" void name(const void* value, const int64_t* shapes, const int64_t* starts, const void* loc,           \
                       const void* attn, float* out, int64_t batch, int64_t tokens, int64_t heads, int64_t dim,     \
                       int64_t queries, int levels, int64_t points) {                                              \
    run<V>(static_cast<const T*>(value), shapes, starts, static_cast<const U*>(loc), static_cast<const U*>(attn),  \
           out, batch, tokens, heads, dim, queries, levels, points);                                               \
  }
ENTRY(msda_f32_v1, 1, float, float)
ENTRY(msda_f32_v8, 8, float, float)
ENTRY(msda_f16_v1, 1, uint16_t, float)
ENTRY(msda_f16_v8, 8, uint16_t, float)
ENTRY(msda_f16f16_v8, 8, uint16_t, uint16_t)

extern "C" void to_float(const uint16_t* h, float* f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) f[i] = msda::half_to_float(h[i]);
}
extern "C" void to_half(const float* f, uint16_t* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = msda::float_to_half(f[i]);
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the header's test harness")
    folder = tmp_path_factory.mktemp("msda_sample")
    (folder / "harness.cc").write_text(_HARNESS)
    library = folder / "harness.so"
    # the CPU library's own flags (setup.py's NATIVE_FLAGS: no contraction into multiply-adds, as nvcc -fmad=false),
    # its entry points visible
    flags = [f for f in native_build.NATIVE_FLAGS if not f.startswith("-fvisibility")]
    subprocess.run([compiler, *flags, "-shared", "-fPIC", f"-I{NATIVE}", str(folder / "harness.cc"), "-o",
                    str(library)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(library))
    for name in ("msda_f32_v1", "msda_f32_v8", "msda_f16_v1", "msda_f16_v8", "msda_f16f16_v8", "to_float", "to_half"):
        getattr(lib, name).restype = None
    return lib


def _elements(lib, value, shapes, starts, loc, attn, vector: int = 1) -> np.ndarray:
    """The harness's output (float sums, before any float16 rounding): float32 value or, given float16 arrays,
    float16 value (and float16 locations and weights where those are float16 too), `vector` channels a thread."""
    kind = "f32" if value.dtype == np.float32 else ("f16f16" if loc.dtype == np.float16 else "f16")
    value, loc, attn = (np.ascontiguousarray(a) for a in (value, loc, attn))
    shapes, starts = (np.ascontiguousarray(a, np.int64) for a in (shapes, starts))
    n, s, m, d = value.shape
    _, lq, _, levels, points, _ = loc.shape
    assert d % vector == 0
    out = np.empty((n, lq, m * d), np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    getattr(lib, f"msda_{kind}_v{vector}")(ptr(value), ptr(shapes), ptr(starts), ptr(loc), ptr(attn), ptr(out),
                                           *map(ctypes.c_int64, (n, s, m, d, lq)), ctypes.c_int(levels),
                                           ctypes.c_int64(points))
    return out


HEADER_CASES = {  # level shapes (H, W), batch, queries, heads, dim, points: odd level counts, non-square levels
    "3 non-square levels, batch 2": ([(6, 5), (3, 7), (2, 4)], 2, 9, 3, 8, 4),
    "5 levels, batch 3, odd D, P=3": ([(7, 3), (5, 9), (4, 2), (2, 3), (1, 5)], 3, 4, 2, 5, 3),
    "1 level, 1-pixel wide": ([(5, 1)], 2, 6, 1, 4, 2),
    "4 levels, D=32 as TESTR, batch 2": ([(8, 8), (4, 5), (2, 3), (1, 1)], 2, 7, 2, 32, 4),
}


@pytest.mark.parametrize("seed, case", enumerate(HEADER_CASES.values()), ids=HEADER_CASES.keys())
def test_header_element_matches_float64_reference(harness, seed, case):
    """Locations in [-0.3, 1.3] plus points planted outside every level and not finite (they contribute nothing);
    one channel a thread and, where D allows, eight (each point computed once for them), the same sums bit for bit."""
    args, ref = _inputs(*case, seed=10 + seed)
    assert np.abs(ref).max() > 0.1
    assert not np.isfinite(args[3]).all() and ((args[3] < 0) | (args[3] > 1)).any()  # the planted points are in
    scalar = _elements(harness, *args)
    assert_close(scalar, ref)
    if case[4] % 8 == 0:
        assert np.array_equal(_elements(harness, *args, vector=8), scalar)


def test_header_element_is_the_cpu_kernel_bit_for_bit(harness, cuda_library):
    """The CUDA kernel's per-thread loop and the CPU kernel's per-row loop sum the same terms in the same order, for
    float32 and for each float16 variant (float16 outputs: the same float sums, rounded once)."""
    args, _ = _inputs(*HEADER_CASES["4 levels, D=32 as TESTR, batch 2"], seed=21)
    options = ort.SessionOptions()
    options.register_custom_ops_library(cuda_library)
    for vector in (1, 8):
        assert np.array_equal(_elements(harness, *args, vector=vector), _session(options).run(None, _feed(args))[0])
    for sampling in (np.float32, np.float16):
        half = _half_args(args, sampling)
        cpu = _session(options, model=half_model(sampling)).run(None, _feed(half))[0]
        assert cpu.dtype == np.float16
        for vector in (1, 8) if sampling == np.float32 else (8,):
            assert np.array_equal(_elements(harness, *half, vector=vector).astype(np.float16), cpu)


def test_header_float16_conversions_are_ieee(harness):
    """Every float16 widened exactly (as numpy does), and float32 narrowed to nearest, ties to even, as numpy does:
    every float16's neighbourhood (itself, the midpoints to its neighbours and one float32 step either side of them),
    both signs, the overflow threshold, subnormals, random bit patterns, infinities and NaN."""
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    widened = np.empty(halves.size, np.float32)
    harness.to_float(ptr(halves), ptr(widened), ctypes.c_int64(halves.size))
    want = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(widened), nan) and np.array_equal(widened[~nan].view(np.uint32),
                                                                     want[~nan].view(np.uint32))

    finite = want[np.isfinite(want)].astype(np.float64)
    finite = np.unique(finite)
    mids = (finite[:-1] + finite[1:]) / 2  # exact in float64, and in float32 (one more bit than float16)
    mids32 = mids.astype(np.float32)
    near = [mids32, np.nextafter(mids32, np.float32(np.inf)), np.nextafter(mids32, np.float32(-np.inf))]
    rng = np.random.default_rng(0)
    extra = [np.array([65504, 65519.996, 65520, 65536, 1e9, 2.0 ** -25, 2.0 ** -26, 3 * 2.0 ** -26, 1e-30, 0.0,
                       np.inf, -np.inf, np.nan], np.float32),
             rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    floats = np.ascontiguousarray(np.concatenate([finite.astype(np.float32), *near, *extra]))
    narrowed = np.empty(floats.size, np.uint16)
    harness.to_half(ptr(floats), ptr(narrowed), ctypes.c_int64(floats.size))
    with np.errstate(over="ignore"):
        want = floats.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(narrowed.view(np.float16)), nan)
    bad = narrowed[~nan] != want[~nan].view(np.uint16)
    assert not bad.any(), (floats[~nan][bad][:5], narrowed[~nan][bad][:5], want[~nan][bad][:5])


def test_header_teeth_a_shifted_location_fails(harness):
    args, ref = _inputs(*HEADER_CASES["5 levels, batch 3, odd D, P=3"], seed=30)
    widths = args[1][:, 1].astype(np.float32)
    args[3][..., 0] += 0.01 / widths[None, None, None, :, None]
    with pytest.raises(AssertionError, match="outputs off"):
        assert_close(_elements(harness, *args), ref)


# --- the CUDA build in a CPU-only onnxruntime --------------------------------------------------------------------
def test_cpu_session_serves_the_fused_op_from_the_cuda_build_unchanged(cuda_library):
    """The library registers the CPU op and the CUDA ops in one domain; onnxruntime's CPU provider (the only one
    here: no GPU, no driver) runs the CPU kernel, whose outputs are those of the CPU-only build, bit for bit."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("an onnxruntime with the CUDA provider: the CPU-only case is the one checked here")
    cpu_only = custom_ops._built(custom_ops.NATIVE_NAME)
    for seed, case in enumerate(CASES.values()):
        args, ref = _inputs(*case, seed=40 + seed)
        options = ort.SessionOptions()
        options.register_custom_ops_library(cuda_library)
        out = _session(options, threads=2).run(None, _feed(args))[0]
        assert_close(out, ref)
        if cpu_only:
            options = ort.SessionOptions()
            options.register_custom_ops_library(cpu_only)
            assert np.array_equal(out, _session(options).run(None, _feed(args))[0])


def test_custom_ops_registers_the_cuda_build_and_names_the_kernel(cuda_library, monkeypatch):
    monkeypatch.delenv(custom_ops.KERNEL_ENV, raising=False)
    assert custom_ops.kernel() == ("native", cuda_library)  # it holds the CPU kernel too
    options = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
    session = _session(options)
    args, ref = _inputs(*CASES["P=1, batch 3, odd D"], seed=50)
    assert_close(session.run(None, _feed(args))[0], ref)
    ops = [custom_ops.FUSED_MSDA_ID]
    assert custom_ops.serving_kernel(ops, session.get_providers()) == "native"
    assert custom_ops.serving_kernel(ops) == "native"
    assert custom_ops.serving_kernel(ops, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == "cuda"
    assert custom_ops.serving_kernel([], ["CUDAExecutionProvider"]) is None
    monkeypatch.setattr(custom_ops, "cuda_library", lambda: None)  # as where nvcc was missing: the CPU build alone
    if custom_ops._built(custom_ops.NATIVE_NAME):
        assert custom_ops.serving_kernel(ops, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == "native"
    monkeypatch.setenv(custom_ops.KERNEL_ENV, "numba")
    assert custom_ops.serving_kernel(ops, ["CUDAExecutionProvider"]) == "numba"


_LOAD_ALONE = """
import ctypes, ctypes.util, sys
import onnxruntime as ort
from d2export.kernels import custom_ops
library = custom_ops.cuda_library()
ctypes.CDLL(library)  # loads (its static initialisers register the fatbin with cudart, which asks no driver)
options = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
assert custom_ops.kernel().library == library
print("driver" if ctypes.util.find_library("cuda") else "no driver")
"""


def test_cuda_build_loads_and_registers_in_a_fresh_process(cuda_library):
    done = subprocess.run([sys.executable, "-c", _LOAD_ALONE], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("driver", "no driver")
