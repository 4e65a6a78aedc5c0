"""The fused MSDA operator's CPU library returns the same bits on every CPU (d2export/kernels/native_build.py): its row
code is cloned for AVX-512, x86-64-v3 and the x86-64 baseline and one clone is picked at load, so a test run on one
CPU exercises one clone only. Two checks cover the others from any machine:
- by construction: the sampling header writes its multiply-adds out (fma, fmaf: one correctly rounded result on any
  target) and the installed libraries were compiled with no contraction (their recorded command lines); read from
  the machine code, whether or not this CPU can run it, each level's code is its own (zmm, ymm with FMA, SSE calling
  fmaf);
- by running: each level this CPU can run, built alone, returns the installed library's bits and matches the float64
  reference, float32 and float16; so does a build with the compiler's default contraction."""
import numpy as np
import onnxruntime as ort
import pytest

from d2export.kernels import custom_ops, native_build
from test_native_msda import (CASES, _feed, _half_args, _inputs, _reference, _session, assert_close, assert_close_half,
                              half_model)



@pytest.fixture(scope="module")
def installed() -> str:
    path = custom_ops.native_library()
    if path is None:
        pytest.fail("the native MSDA library is not built: run `pip install --no-deps --no-build-isolation -e .`")
    return path


@pytest.fixture(scope="module")
def level_builds(tmp_path_factory) -> dict[str, str]:
    """One build per x86-64 level, clones off, as setup.py's flags make it, and the clones contracted."""
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp("native_levels")
    found = {}
    for level in native_build.LEVELS:
        found[level] = str(native_build.build(folder / f"{level}.so", level=level))
    found["clones, contracted"] = str(native_build.build(folder / "clones-fma.so", contract=True))
    return found


def test_installed_libraries_were_built_without_contraction(installed, level_builds):
    """The CPU library and, where nvcc built it, the CUDA build (its CPU kernel and its host code): every compile
    recorded -ffp-contract=off; a contracted build's record is told apart."""
    for library in [installed] + [p for p in [custom_ops.cuda_library()] if p]:
        switches = native_build.recorded_switches(library)
        assert switches and not native_build.contracts(switches), (library, switches)
    assert native_build.contracts(native_build.recorded_switches(level_builds["clones, contracted"]))
    assert native_build.contracts("")  # nothing recorded proves nothing


def _clone_code(library: str) -> dict[str, str]:
    """clone suffix (avx512f, arch_x86_64_v3, default; "" for a build without clones, where the row is inlined into
    its task) -> the float32 row's disassembly."""
    return {(name.split("[clone .")[1].split("]")[0] if "[clone ." in name else ""): code
            for name, code in native_build.disassembly(library).items()
            if ("::float_row(" in name or "row_task<float, float>" in name) and ".resolver" not in name}


def test_the_levels_compared_are_different_machine_code(installed, level_builds):
    """What the run below compares is not one code path thrice: the AVX-512 build works on zmm registers, the
    x86-64-v3 build on ymm with the header's multiply-adds as FMA instructions, the baseline on neither, calling
    the C library's fmaf; the installed library holds those three clones."""
    clones = _clone_code(installed)
    clones.pop("", None)  # the task calling the clones
    assert set(clones) == {"avx512f", "arch_x86_64_v3", "default"}, sorted(clones)
    builds = {level: _clone_code(level_builds[level])[""] for level in native_build.LEVELS}
    for code in (clones["avx512f"], builds["x86-64-v4"]):
        assert "%zmm" in code and native_build.FMA.search(code)
    for code in (clones["arch_x86_64_v3"], builds["x86-64-v3"]):
        assert "%ymm" in code and "%zmm" not in code and native_build.FMA.search(code)
    for code in (clones["default"], builds["x86-64"]):
        assert "%ymm" not in code and not native_build.FMA.search(code) and "fmaf" in code


def _session_of(library: str, model: bytes = custom_ops.fused_msda_model()) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    return _session(options, model=model)


def test_every_level_this_cpu_runs_returns_the_installed_bits(installed, level_builds):
    runnable = native_build.runnable_levels()
    assert "x86-64" in runnable  # every x86-64 CPU runs the baseline
    print(f"\nlevels run on this CPU: {', '.join(runnable)}")
    base = _session_of(installed)
    for seed, case in enumerate(CASES.values()):
        args, ref = _inputs(*case, seed=60 + seed)
        want = base.run(None, _feed(args))[0]
        assert_close(want, ref)
        for level in runnable:
            assert np.array_equal(_session_of(level_builds[level]).run(None, _feed(args))[0], want), (level, case)
    for sampling in (np.float32, np.float16):  # float16 value: the same float sums, rounded once
        args, _ = _inputs(*CASES["Lq=1, 4 heads, D=32"], seed=70)
        half = _half_args(args, sampling)
        want = _session_of(installed, half_model(sampling)).run(None, _feed(half))[0]
        assert_close_half(want, _reference(half))
        for level in runnable:
            got = _session_of(level_builds[level], half_model(sampling)).run(None, _feed(half))[0]
            assert np.array_equal(got, want), (level, sampling)


def test_contraction_can_no_longer_change_the_kernel(installed, level_builds):
    """The header leaves the compiler nothing to contract: built with GCC's default contraction, the clones return the
    installed bits too (the flag stays as a guard for code added later)."""
    args, ref = _inputs(*CASES["Lq=1, 4 heads, D=32"], seed=80)
    want = _session_of(installed).run(None, _feed(args))[0]
    assert_close(want, ref)
    assert np.array_equal(_session_of(level_builds["clones, contracted"]).run(None, _feed(args))[0], want)


def test_benchmark_prints_every_build_and_its_bits(installed, capsys):
    from benchmarks import native

    assert native.main(["--size", "128", "--decoder-queries", "40", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    names = ["installed", "contracted", *native_build.runnable_levels()]
    assert len(rows) == 2 * len(names) and all("same bits" in r for r in rows), out
    assert [r.split()[0] for r in rows[:len(names)]] == names
