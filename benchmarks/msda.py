"""MSDA benchmark at TESTR sizes: our samplers against the known pure-PyTorch replacements and the machine's floor.

    .venv/bin/python tools/benchmark.py msda [--sizes 640 1024] [--threads 1] [--rounds 7] [--no-memory]

Shapes: input 640² / 1024², 4 levels at strides 8-64, M=8 heads, D=32, P=4; encoder Lq = Len_in, decoder Lq 1600
(TESTR's location branch, 100×16) and 2500 (text branch, 100×25). Sampling locations are TESTR-like: a reference
point per query (the query's own pixel in the encoder, random boxes' points in the decoder) plus offsets of a few
pixels, ~5% of them outside the image. onnxruntime runs on the CPU with the thread count given; every formulation is
warmed up, then timed in interleaved rounds (medians). Peak memory: the growth of peak RSS during one call, each
formulation alone in a fresh child process.

The floor of one call: the larger of its compute (Lq·M·L·P·4·D multiply-adds at this machine's measured single-core
float32 FMA rate, times the threads) and its memory traffic (value, locations, weights read once, the output written
once, at the measured copy bandwidth). The fused operator (`export.sampler=fused`) is timed through onnxruntime with
its registration, as a user runs it; next to it, its kernel called straight from numpy, and that kernel with every
sampling point at one pixel (reads from L1), which split the fused call into copying, reading and arithmetic.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.e2e import interleaved
from d2export.argparsing import parser
from d2export.ops.msda import _gather, multi_scale_deformable_attention

HEADS, DIM, LEVELS, POINTS = 8, 32, 4, 4
STRIDES = (8, 16, 32, 64)


# --- the replacements users have today (written here from their published descriptions) -----------------------
def reference_msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Deformable-DETR's pure-PyTorch core: per-level F.grid_sample, level sizes as Python ints."""
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    sizes = [(int(h), int(w)) for h, w in spatial_shapes]
    levels = value.split([h * w for h, w in sizes], dim=1)
    grids = 2 * sampling_locations - 1
    samples = []
    for level, (h, w) in enumerate(sizes):
        value_l = levels[level].flatten(2).transpose(1, 2).reshape(n * m, d, h, w)
        grid_l = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        samples.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = attention_weights.transpose(1, 2).reshape(n * m, 1, lq, n_levels * n_points)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1).view(n, m * d, lq)
    return out.transpose(1, 2).contiguous()


def _four_gather_grid_sample(image, grid):
    """mmcv-style bilinear sampler: pad by 1 px, then four torch.gather calls on channel-expanded int64 indices."""
    n, c, h, w = image.shape
    _, gh, gw, _ = grid.shape
    x = ((grid[..., 0] + 1) * w - 1) / 2 + 1  # +1: the padding
    y = ((grid[..., 1] + 1) * h - 1) / 2 + 1
    x, y = x.reshape(n, -1), y.reshape(n, -1)
    x0, y0 = torch.floor(x).long(), torch.floor(y).long()
    x1, y1 = x0 + 1, y0 + 1
    wa, wb = ((x1 - x) * (y1 - y)).unsqueeze(1), ((x1 - x) * (y - y0)).unsqueeze(1)
    wc, wd = ((x - x0) * (y1 - y)).unsqueeze(1), ((x - x0) * (y - y0)).unsqueeze(1)
    padded = F.pad(image, (1, 1, 1, 1)).view(n, c, -1)
    pw, ph = w + 2, h + 2
    x0, x1 = x0.clamp(0, pw - 1), x1.clamp(0, pw - 1)
    y0, y1 = y0.clamp(0, ph - 1), y1.clamp(0, ph - 1)

    def corner(xi, yi):
        return torch.gather(padded, 2, (xi + yi * pw).unsqueeze(1).expand(-1, c, -1))

    out = corner(x0, y0) * wa + corner(x0, y1) * wb + corner(x1, y0) * wc + corner(x1, y1) * wd
    return out.view(n, c, gh, gw)


def mmcv_style_msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """The Deformable-DETR core with mmcv's 4-gather sampler in place of F.grid_sample (what mmdeploy exports
    for runtimes without GridSample)."""
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    sizes = [(int(h), int(w)) for h, w in spatial_shapes]
    levels = value.split([h * w for h, w in sizes], dim=1)
    grids = 2 * sampling_locations - 1
    samples = [_four_gather_grid_sample(levels[lv].flatten(2).transpose(1, 2).reshape(n * m, d, h, w),
                                        grids[:, :, :, lv].transpose(1, 2).flatten(0, 1))
               for lv, (h, w) in enumerate(sizes)]
    weights = attention_weights.transpose(1, 2).reshape(n * m, 1, lq, n_levels * n_points)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1).view(n, m * d, lq)
    return out.transpose(1, 2).contiguous()


# --- inputs ------------------------------------------------------------------------------------------------------
def make_inputs(size: int, lq: int | None, seed: int = 0):
    """TESTR-like MSDA inputs for a size×size image; lq None = encoder (one query per token)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = torch.tensor([(size // s, size // s) for s in STRIDES])
    areas = shapes.prod(1)
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    s = int(areas.sum())
    if lq is None:  # encoder: each token's reference point is its own pixel centre
        ref = torch.cat([torch.stack(torch.meshgrid((torch.arange(h) + 0.5) / h, (torch.arange(w) + 0.5) / w,
                                                    indexing="ij")[::-1], -1).reshape(-1, 2) for h, w in shapes.tolist()])
    else:
        ref = torch.rand(lq, 2, generator=gen)
    lq = ref.shape[0]
    pixel_offsets = 2.0 * torch.randn(1, lq, HEADS, LEVELS, POINTS, 2, generator=gen)
    wh = shapes.flip(-1).to(torch.float32).view(1, 1, 1, LEVELS, 1, 2)
    loc = ref.view(1, lq, 1, 1, 1, 2) + pixel_offsets / wh
    value = torch.randn(1, s, HEADS, DIM, generator=gen)
    attn = torch.rand(1, lq, HEADS, LEVELS * POINTS, generator=gen).softmax(-1).view(1, lq, HEADS, LEVELS, POINTS)
    return value, shapes, starts, loc, attn


# --- formulations ------------------------------------------------------------------------------------------------
class _Core(torch.nn.Module):
    def __init__(self, fn, **kw):
        super().__init__()
        self.fn, self.kw = fn, kw

    def forward(self, *args):
        return self.fn(*args, **self.kw)


def _ours(sampler):
    return _Core(multi_scale_deformable_attention, sampler=sampler)


# name -> (module, "eager" or opset to export at)
FORMULATIONS = {
    "eager reference (per-level grid_sample)": (_Core(reference_msda), "eager"),
    "eager ours: pytorch": (_ours("pytorch"), "eager"),
    "ORT reference (GridSample)": (_Core(reference_msda), 17),
    "ORT mmcv-style 4-gather": (_Core(mmcv_style_msda), 17),
    "ORT ours: grid_sample": (_ours("grid_sample"), 17),
    "ORT ours: gather, one piece": (_Core(_gather, chunks=1), 17),
    "ORT ours: gather (default)": (_ours("gather"), 17),
    # the fused operator with each of its kernels (D2EXPORT_MSDA_KERNEL): the native library, which onnxruntime calls
    # in place on its own threads, and numba's behind onnxruntime-extensions
    "ORT ours: fused, native kernel": (_ours("fused"), 17),
    "ORT ours: fused, numba kernel": (_ours("fused"), 17),
    # the numba kernel called straight from numpy: the rest of "fused, numba kernel" is the copying in and out of
    # onnxruntime-extensions; with every sampling point at one pixel, its reads stay in L1: what is left is compute
    "fused kernel alone": (None, "kernel"),
    "fused kernel alone, every point at one pixel": (None, "kernel, one pixel"),
}
NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]
DYNAMIC_AXES = {"value": {0: "batch", 1: "tokens"}, "spatial_shapes": {0: "levels"}, "level_start_index": {0: "levels"},
                "sampling_locations": {0: "batch", 1: "queries"}, "attention_weights": {0: "batch", 1: "queries"}}


def build_runner(name, inputs, threads):
    module, how = FORMULATIONS[name]
    if str(how).startswith("kernel"):
        from d2export.kernels import numba_msda

        numba_msda.numba.set_num_threads(threads)
        arrays = [t.numpy() for t in inputs]
        if how.endswith("one pixel"):
            arrays[3] = np.full_like(arrays[3], 0.37)
        return lambda: numba_msda.msda(*arrays)
    if how == "eager":
        def run():
            with torch.no_grad():
                module(*inputs)
        return run
    import onnxruntime as ort
    buf = io.BytesIO()
    # sizes dynamic, as in an exported model: with static ones the exporter folds the index arithmetic into int64
    # constants, and the gather rows would time a graph no model exports
    torch.onnx.export(module, inputs, buf, input_names=NAMES, output_names=["out"], opset_version=how, dynamo=False,
                      dynamic_axes=DYNAMIC_AXES)
    from d2export.kernels import custom_ops

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    with custom_ops.forcing({FUSED: "native", FUSED_NUMBA: "numba"}.get(name)):
        custom_ops.register(opts, custom_ops.graph_ops(__import__("onnx").load_from_string(buf.getvalue())))
    session = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
    used = {i.name for i in session.get_inputs()}  # the reference bakes the level sizes: its graph drops them
    feed = {k: v.numpy() for k, v in zip(NAMES, inputs) if k in used}
    return lambda: session.run(None, feed)


def _rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_memory_mb(name, size, lq, threads):
    """Growth of peak RSS over the first call, in a fresh child process."""
    cmd = [sys.executable, "-m", "benchmarks.msda", "--peak-of", name, "--sizes", str(size), "--threads",
           str(threads), "--lq", str(lq or 0)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=_ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mb"]


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_peak(name, size, lq, threads):
    torch.set_num_threads(threads)
    run = build_runner(name, make_inputs(size, lq or None), threads)
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark (Linux)
        f.write("5")
    before = _rss_kb("VmRSS")
    run()  # the first call: it sizes onnxruntime's arena, which later calls reuse
    print(json.dumps({"peak_mb": (_rss_kb("VmHWM") - before) / 1024}))


def bench_case(size, lq, threads, rounds, memory):
    inputs = make_inputs(size, lq)
    runners = {name: build_runner(name, inputs, threads) for name in FORMULATIONS}
    outs = {name: run() for name, run in runners.items()}  # warm-up
    native, numba_ = (np.asarray(outs[k][0], np.float64) for k in (FUSED, FUSED_NUMBA))
    kernels_differ = float(np.abs(native - numba_).max() / np.abs(numba_).max())
    ms = {name: 1000 * sec for name, sec in interleaved(runners, rounds, warmup=0).items()}
    peaks = {name: peak_memory_mb(name, size, lq, threads) for name in runners} if memory else {}
    return inputs[3].shape[1], ms, peaks, kernels_differ


GATHER = "ORT ours: gather (default)"
FUSED, FUSED_NUMBA = "ORT ours: fused, native kernel", "ORT ours: fused, numba kernel"
RATIOS = [  # (label, slower, faster)
    ("native kernel vs numba kernel", FUSED_NUMBA, FUSED),
    ("fused vs gather", GATHER, FUSED),
    ("fused vs eager reference", "eager reference (per-level grid_sample)", FUSED),
    ("gather vs gather in one piece", "ORT ours: gather, one piece", GATHER),
    ("gather vs eager reference", "eager reference (per-level grid_sample)", GATHER),
    ("gather vs ORT GridSample reference", "ORT reference (GridSample)", GATHER),
    ("gather vs ORT mmcv-style", "ORT mmcv-style 4-gather", GATHER),
]


# --- the floor ---------------------------------------------------------------------------------------------------
def machine_rates() -> dict:
    """Copy bandwidth (bytes read + written per second, 256 MB arrays) and single-core float32 FMA rate (a
    cache-resident matrix product on one thread, 2 flops per FMA): the best of a few tries each."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    copy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    mm = min(_timed(lambda: [torch.mm(a, b) for _ in range(20)]) for _ in range(5)) / 20
    torch.set_num_threads(threads)
    return {"bandwidth": 2 * src.nbytes / copy, "fma": 256**3 / mm}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def floor_ms(inputs, rates: dict, threads: int) -> float:
    value, _, _, loc, attn = inputs
    n, lq, m, levels, points, _ = loc.shape
    fmas = n * lq * m * levels * points * 4 * value.shape[-1]
    traffic = 4 * (value.numel() + loc.numel() + attn.numel() + n * lq * m * value.shape[-1])
    return 1e3 * max(fmas / (rates["fma"] * threads), traffic / rates["bandwidth"])


def main(argv=None):
    p = parser("benchmark.py msda", __doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[640, 1024], help="square input sizes")
    p.add_argument("--decoder-queries", type=int, nargs="*", default=[1600, 2500], help="decoder query counts (none: encoder only)")
    p.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (medians)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--peak-of", help=argparse.SUPPRESS)
    p.add_argument("--lq", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_of:
        return _child_peak(args.peak_of, args.sizes[0], args.lq, args.threads)
    torch.set_num_threads(args.threads)
    import onnxruntime
    rates = machine_rates()
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, {args.threads} thread(s), "
          f"{args.rounds} rounds, medians in ms (peak RSS growth in MB); load average {os.getloadavg()[0]:.1f}; "
          f"measured copy bandwidth {rates['bandwidth'] / 1e9:.1f} GB/s, one core {rates['fma'] / 1e9:.1f} GFMA/s")
    for size in args.sizes:
        for lq in [None, *args.decoder_queries]:
            n_q, ms, peaks, differ = bench_case(size, lq, args.threads, args.rounds, not args.no_memory)
            floor = floor_ms(make_inputs(size, lq), rates, args.threads)
            print(f"\n## {size}x{size}, {'encoder' if lq is None else 'decoder'} Lq={n_q}")
            for name in ms:
                peak = f"  ({peaks[name]:7.0f} MB)" if peaks else ""
                print(f"  {name:42s} {ms[name]:9.1f} ms{peak}")
            print(f"  {'floor (compute / memory traffic)':42s} {floor:9.1f} ms")
            for label, slow, fast in RATIOS:
                print(f"  ratio {label:38s} {ms[slow] / ms[fast]:5.2f}x")
            print(f"  ratio {'fused vs floor':38s} {ms[FUSED] / floor:5.2f}x the floor")
            print(f"  native vs numba kernel: largest difference {differ:.1e} of the output's largest value")
            alone, cached = ms["fused kernel alone"], ms["fused kernel alone, every point at one pixel"]
            print(f"  of the numba call: onnxruntime-extensions' copies {ms[FUSED_NUMBA] - alone:.1f} ms, the "
                  f"kernel's reads from value {alone - cached:.1f} ms, its arithmetic {cached:.1f} ms")


if __name__ == "__main__":
    main()
