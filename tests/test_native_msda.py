"""The native fused MSDA kernel (d2export/kernels/native, built by setup.py where a C++ compiler exists): parity through
a real onnxruntime session with the float64 reference and with the numba kernel, its errors, and how
`custom_ops` chooses between the two kernels."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from d2export.kernels import custom_ops
from d2export.kernels.numba_msda import msda as numba_msda
from msda_reference import edge_locations, msda_reference, random_msda_inputs

ROOT = Path(__file__).resolve().parent.parent
NAMES = list(custom_ops.FUSED_MSDA_INPUTS)
# Float32 accumulation against float64: a few 1e-7 of the output's scale (measured 1.4e-7); 1e-6 leaves room for
# summation order and nothing more (a 1/100-pixel shift is far outside it: test_a_wrong_kernel_fails).
RTOL = 1e-6


@pytest.fixture(scope="module")
def library() -> str:
    """The built library. Skipped only where no compiler could have built it: with one, a missing library fails."""
    path = custom_ops.native_library()
    if path is None:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler on this machine, so setup.py could not build the native MSDA library")
        pytest.fail("a C++ compiler exists but the native MSDA library is not built (no d2export/kernels/"
                    "_msda_native*.so): run `pip install --no-deps --no-build-isolation -e .`, which builds it")
    return path


def _model(value: int = TensorProto.FLOAT, sampling: int = TensorProto.FLOAT) -> bytes:
    """One fused MSDA node. `value`: the value's and output's element type; `sampling`: the locations' and weights'."""
    kinds = {TensorProto.FLOAT: "float", TensorProto.FLOAT16: "float16"}
    return custom_ops.fused_msda_model(kinds[value], kinds[sampling])


MODEL = _model()
HALF_MODELS = {np.float32: _model(TensorProto.FLOAT16, TensorProto.FLOAT),  # a float16 graph's fused node
               np.float16: _model(TensorProto.FLOAT16, TensorProto.FLOAT16)}  # everything float16


def half_model(sampling) -> bytes:
    """The one-node graph with float16 value and output, `sampling` (np.float32 or np.float16) locations and weights."""
    return HALF_MODELS[sampling]


def _session(options: ort.SessionOptions, threads: int = 1, model: bytes = MODEL) -> ort.InferenceSession:
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _native(library: str, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    return _session(options, threads)


def _feed(args) -> dict[str, np.ndarray]:
    return {n: np.ascontiguousarray(a.numpy() if hasattr(a, "numpy") else a) for n, a in zip(NAMES, args)}


def assert_close(out: np.ndarray, want) -> None:
    """|out - want| <= RTOL * (|want| + max|want|): relative per element, and relative to the output's scale where an
    element is a near-cancelled sum."""
    want = np.asarray(want, np.float64)
    assert out.dtype == np.float32 and out.shape == want.shape, (out.dtype, out.shape, want.shape)
    scale = float(np.abs(want).max())
    err = np.abs(out.astype(np.float64) - want)
    bad = err > RTOL * (np.abs(want) + scale)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} outputs off: worst {err.max():.3g} at scale {scale:.3g}"


CASES = {  # level shapes (H, W), batch, queries, heads, dim, points
    "3 non-square levels, batch 2, 3 heads, P=4": ([(6, 5), (3, 7), (2, 4)], 2, 9, 3, 8, 4),
    "P=1, batch 3, odd D": ([(4, 7), (2, 3), (1, 5)], 3, 5, 2, 5, 1),
    "Lq=1, 4 heads, D=32": ([(5, 3), (3, 2), (2, 2)], 2, 1, 4, 32, 4),
    "1-pixel levels, one head": ([(1, 1), (2, 1), (1, 3)], 1, 6, 1, 3, 2),
}
# Locations planted outside every level (finite, beyond the padding's reach) and not finite at all.
PLANTED = [(-0.7, 0.5), (1.6, 0.5), (0.5, -0.4), (0.5, 1.9), (40.0, -40.0), (np.nan, 0.5), (0.5, np.nan),
           (np.inf, 0.5), (-np.inf, -np.inf)]


def _inputs(shapes, n, lq, heads, dim, points, seed):
    """Random inputs with locations in [-0.3, 1.3] plus PLANTED ones, and the float64 reference."""
    args = [a.numpy().copy() for a in random_msda_inputs(shapes, n=n, lq=lq, heads=heads, dim=dim, points=points,
                                                         lo=-0.3, hi=1.3, seed=seed)]
    count = args[4].size
    spots = np.random.default_rng(seed).choice(count, size=min(len(PLANTED), count // 2), replace=False)
    args[3][np.unravel_index(spots, args[4].shape)] = PLANTED[:len(spots)]
    return args, _reference(args)


def _reference(args) -> np.ndarray:
    """The float64 reference of `args` (any float type, widened exactly): the reference has no notion of a non-finite
    location, so those points get weight 0 there (they contribute nothing)."""
    ref_args = [a.astype(np.float64) if a.dtype.kind == "f" else a.copy() for a in args]
    finite = np.isfinite(ref_args[3]).all(-1)
    ref_args[3][~finite] = 0.5
    ref_args[4][~finite] = 0.0
    return msda_reference(*map(torch.from_numpy, ref_args)).numpy()


def _half_args(args, sampling=np.float32):
    """`args` with value float16 and locations and weights `sampling`: what the float16 variants read."""
    return [args[0].astype(np.float16), args[1], args[2], args[3].astype(sampling), args[4].astype(sampling)]


@pytest.mark.parametrize("seed, case", enumerate(CASES.values()), ids=CASES.keys())
def test_native_matches_float64_reference_and_numba(library, seed, case):
    args, ref = _inputs(*case, seed=seed)
    assert np.abs(ref).max() > 0.1  # not a vacuous all-zero comparison
    out = _native(library).run(None, _feed(args))[0]
    assert_close(out, ref)
    assert_close(out, numba_msda(*args))
    # rows split over onnxruntime's threads (KernelContext_ParallelFor): each row computed alike, bit for bit
    assert np.array_equal(out, _native(library, threads=2).run(None, _feed(args))[0])


def test_native_at_pixel_edges_and_far_outside(library):
    h, w = 3, 4
    grid = edge_locations(h, w)
    value, shapes, starts, _, _ = random_msda_inputs([(h, w)], n=1, heads=1, dim=3, points=1)
    attn = np.random.default_rng(1).random((1, grid.shape[1], 1, 1, 1), np.float32)
    args = [value.numpy(), shapes.numpy(), starts.numpy(), grid.numpy(), attn]
    out = _native(library).run(None, _feed(args))[0]
    assert_close(out, msda_reference(*map(torch.from_numpy, args)).numpy())


def test_a_wrong_kernel_fails(library):
    """The comparison has teeth: a kernel sampling 1/100 pixel off, or with x and y swapped, fails it."""
    args, ref = _inputs(*CASES["3 non-square levels, batch 2, 3 heads, P=4"], seed=3)
    session = _native(library)
    shifted = [a.copy() for a in args]
    widths = args[1][:, 1].astype(np.float32)  # per level, along the level axis of [N, Lq, M, L, P, 2]
    shifted[3][..., 0] += 0.01 / widths[None, None, None, :, None]
    swapped = [a.copy() for a in args]
    swapped[3] = np.ascontiguousarray(args[3][..., ::-1])
    for wrong in (shifted, swapped):
        with pytest.raises(AssertionError, match="outputs off"):
            assert_close(session.run(None, _feed(wrong))[0], ref)


# --- float16 ------------------------------------------------------------------------------------------------------
# The float16 variants widen their inputs exactly and sum in float32 like the float32 kernel, then round once. Against
# the float64 reference of the very float16 inputs they read, the error is that sum's (assert_close's bound: e =
# RTOL * (|want| + max|want|)) plus one rounding to float16 of a value within e of want: at most half a float16 ulp,
# 2^-11 relative for normal numbers, 2^-25 absolute below 2^-14 (subnormals).
HALF_UNIT_ROUNDOFF, HALF_SUBNORMAL_HALF_ULP = 2.0 ** -11, 2.0 ** -25


def assert_close_half(out: np.ndarray, want) -> None:
    want = np.asarray(want, np.float64)
    assert out.dtype == np.float16 and out.shape == want.shape, (out.dtype, out.shape, want.shape)
    scale = float(np.abs(want).max())
    e = RTOL * (np.abs(want) + scale)
    err = np.abs(out.astype(np.float64) - want)
    bad = err > HALF_UNIT_ROUNDOFF * (np.abs(want) + e) + e + HALF_SUBNORMAL_HALF_ULP
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} outputs off: worst {err.max():.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("sampling", [np.float32, np.float16], ids=["value float16", "all float16"])
@pytest.mark.parametrize("seed, case", enumerate(CASES.values()), ids=CASES.keys())
def test_native_float16_matches_float64_reference_and_the_float32_kernel(library, seed, case, sampling):
    """The float16 variants against the float64 reference of their own (float16) inputs, within one float16 rounding
    of the float32 sum; and bit for bit the float32 kernel's output on the same inputs widened, rounded once."""
    args, _ = _inputs(*case, seed=60 + seed)
    half = _half_args(args, sampling)
    ref = _reference(half)
    assert np.abs(ref).max() > 0.1
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    out = _session(options, model=half_model(sampling)).run(None, _feed(half))[0]
    assert_close_half(out, ref)
    widened = [a.astype(np.float32) if a.dtype == np.float16 else a for a in half]
    assert np.array_equal(out, _native(library).run(None, _feed(widened))[0].astype(np.float16))
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    assert np.array_equal(out, _session(options, threads=2, model=half_model(sampling)).run(None, _feed(half))[0])


def test_a_wrong_float16_kernel_fails(library):
    """The float16 comparison has teeth: sampling 1/100 pixel off fails it, and so does one output two float16 ulps
    off (what summing in float16 would cost), while the right output passes."""
    args, _ = _inputs(*CASES["Lq=1, 4 heads, D=32"], seed=70)
    half = _half_args(args)
    ref = _reference(half)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = _session(options, model=half_model(np.float32))
    out = session.run(None, _feed(half))[0]
    assert_close_half(out, ref)
    shifted = [a.copy() for a in half]
    shifted[3][..., 0] += 0.01 / args[1][:, 1].astype(np.float32)[None, None, None, :, None]
    with pytest.raises(AssertionError, match="outputs off"):
        assert_close_half(session.run(None, _feed(shifted))[0], ref)
    nudged = out.copy()
    k = int(np.argmax(np.abs(out)))
    nudged.flat[k] = np.nextafter(np.nextafter(out.flat[k], np.float16(np.inf)), np.float16(np.inf))
    with pytest.raises(AssertionError, match="1 of .* outputs off"):
        assert_close_half(nudged, ref)


def test_float16_value_with_float32_sampling_keeps_the_locations_precision(library):
    """The (float16, float32) variant reads the locations as float32: a location that float16 rounds by 0.2 pixel on
    a 1024-wide level (its spacing there: half a pixel) samples where float32 puts it; the all-float16 variant does
    not."""
    width = 1024
    value = np.zeros((1, width, 1, 1), np.float16)
    value[0, :, 0, 0] = np.arange(width) % 2  # alternating columns: the output is the sampled x's distance to a column
    x = np.float32((700 + 0.5 + 0.3) / width)  # 0.3 px right of a pixel centre; float16's spacing at 0.68: 1/2048
    loc = np.array([x, 0.5], np.float32).reshape(1, 1, 1, 1, 1, 2)
    attn = np.ones((1, 1, 1, 1, 1), np.float32)
    args = [value, np.array([[1, width]], np.int64), np.array([0], np.int64), loc, attn]
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    out = _session(options, model=half_model(np.float32)).run(None, _feed(args))[0]
    assert_close_half(out, _reference(args))
    assert abs(float(out.ravel()[0]) - 0.3) < 1e-3
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    rounded = _session(options, model=half_model(np.float16)).run(None, _feed(_half_args(args, np.float16)))[0]
    assert abs(float(rounded.ravel()[0]) - 0.3) > 0.1


def test_bad_shapes_are_named_in_onnxruntime_errors(library):
    args, _ = _inputs(*CASES["3 non-square levels, batch 2, 3 heads, P=4"], seed=4)
    session = _native(library)
    value, shapes, starts, loc, attn = args
    bad_shapes = shapes.copy()
    bad_shapes[1, 0] = -3
    for bad, message in [
        ((value[:, :20], shapes, starts, loc, attn), r"need more tokens than value has \(20\)"),
        ((value, shapes, starts, loc, attn[..., :2]), r"attention_weights \(2, 9, 3, 3, 2\) do not match"),
        ((value, shapes, starts, loc[:, :, :2], attn), "sampling_locations .* do not match value"),
        ((value, shapes[:2], starts, loc, attn), r"spatial_shapes \(2, 2\) / level_start_index \(3,\) do not match 3"),
        ((value[0], shapes, starts, loc, attn), r"value \(59, 3, 8\) is not \[N, S, M, D\]"),
        ((value, bad_shapes, starts, loc, attn), "negative size or start"),
    ]:
        with pytest.raises(Exception, match=message) as raised:
            session.run(None, _feed(bad))
        assert "MultiScaleDeformableAttention" in str(raised.value)  # onnxruntime names the node that failed
    assert np.isfinite(session.run(None, _feed(args))[0]).all()  # the session goes on serving


def test_kernel_prefers_native_and_leaves_spinning(library, monkeypatch):
    monkeypatch.delenv(custom_ops.KERNEL_ENV, raising=False)
    assert custom_ops.kernel() == ("native", library)
    assert Path(library).parent == ROOT / "d2export" / "kernels"
    options = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
    with pytest.raises(RuntimeError):  # spinning left as onnxruntime has it: the kernel runs on the pool's threads
        options.get_session_config_entry("session.intra_op.allow_spinning")
    args, ref = _inputs(*CASES["P=1, batch 3, odd D"], seed=5)
    native = _session(options).run(None, _feed(args))[0]
    assert_close(native, ref)
    assert np.array_equal(native, _native(library).run(None, _feed(args))[0])


def test_environment_forces_numba_and_refuses_nonsense(library, monkeypatch):
    monkeypatch.setenv(custom_ops.KERNEL_ENV, "numba")
    assert custom_ops.kernel().name == "numba"
    options = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"  # numba's own threads
    args, _ = _inputs(*CASES["Lq=1, 4 heads, D=32"], seed=6)
    assert np.array_equal(_session(options).run(None, _feed(args))[0], numba_msda(*args))  # the numba kernel itself

    monkeypatch.setenv(custom_ops.KERNEL_ENV, "Native")
    assert custom_ops.kernel() == ("native", library)
    monkeypatch.setenv(custom_ops.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match=f"{custom_ops.KERNEL_ENV}='cuda': expected one of native, numba"):
        custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
    monkeypatch.setenv(custom_ops.KERNEL_ENV, "native")
    monkeypatch.setattr(custom_ops, "native_library", lambda: None)  # as where no compiler built it
    with pytest.raises(custom_ops.MissingExtra, match="native MSDA library is not built"):
        custom_ops.kernel()


def test_forcing_names_the_kernel_for_a_block_and_restores_the_environment(library, monkeypatch):
    monkeypatch.setenv(custom_ops.KERNEL_ENV, "native")
    with custom_ops.forcing("numba"):
        assert custom_ops.kernel().name == "numba"
    assert os.environ[custom_ops.KERNEL_ENV] == "native"
    monkeypatch.delenv(custom_ops.KERNEL_ENV)
    with custom_ops.forcing(None):
        assert custom_ops.kernel().name == "native"
    with pytest.raises(RuntimeError), custom_ops.forcing("numba"):
        raise RuntimeError("the block failed")
    assert custom_ops.KERNEL_ENV not in os.environ


_NATIVE_ALONE = """
import sys
from d2export.kernels import custom_ops
import onnxruntime as ort
options = custom_ops.register(ort.SessionOptions(), [custom_ops.FUSED_MSDA_ID])
assert custom_ops.kernel().name == "native"
loaded = {"torch", "numba", "onnxruntime_extensions"} & set(sys.modules)
assert not loaded, loaded
print("ok")
"""


def test_native_kernel_loads_no_python_kernel_packages(library):
    env = {k: v for k, v in os.environ.items() if k != custom_ops.KERNEL_ENV} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _NATIVE_ALONE], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
