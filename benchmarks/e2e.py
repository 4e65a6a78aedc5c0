"""End-to-end benchmark: the exported text spotter in onnxruntime against the PyTorch model it came from.

    .venv/bin/python tools/benchmark.py e2e [--config textdet] [--size 640] [--threads 2] [--rounds 5]
        [--samplers gather fused] [--sizes 320 640 1024 1600] [--plot docs/performance.png] [--dynamo] [--fp16]
        [--int8 dynamic static]
        [--out DIR [--reuse]]

One run, one machine, in this order:
1. export: each sampler in a fresh child process (the config's dummy size, dynamic H/W), timed (model build and
   export separately) with the child's peak RSS; then onnxruntime session creation, timed three ways: without the
   optimized-model cache, the first time with it (it writes the cache), and from the cache (as every later start);
2. latency at --size², batch 1: the model as a user runs it today on a CPU (eager PyTorch, MSDA swapped for the
   per-level grid_sample core) against every exported graph on onnxruntime's CPU provider, the same explicit
   thread count on both sides; all warmed up, then timed in interleaved rounds; medians and ratios;
3. parity of every graph against eager on that image, and the compute floor: the eager model's multiply-adds at the
   best float32 rate this machine reaches on those threads, hence the most any float32 graph can beat eager by;
4. per image size (--sizes): ms per image and the peak RSS of a fresh process that loads the model and runs it
   (eager and every graph, one child each), in one table and, with --plot, one figure;
5. an onnxruntime profile of every graph (warm runs only): its nodes as exported and as onnxruntime runs them, wall
   against kernel time (the time outside any kernel), the top op types; then, for the first, time per op type, the
   MSDA sampling cores' share, the top nodes;
6. with --fp16, a float16 copy of the first graph and its parity against eager;
with --int8, int8 copies of every graph (dynamic; static calibrated on 8 pictures) join steps 2-4 as rows of their
own, and the header's CPU features (VNNI, AMX) say what int8 can gain here.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from d2export.argparsing import parser
from d2export.kernels import custom_ops

ROOT = Path(__file__).resolve().parent.parent
EAGER = "eager PyTorch (per-level grid_sample)"


def peak_rss_gb() -> float:
    """This process's peak RSS since it started (VmHWM; getrusage's maxrss would carry the parent's over exec)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20


# --- export, in a child process -------------------------------------------------------------------------------
def _export_child(config: str, sampler: str, exporter: str, path: str, *overrides: str) -> None:
    import torch

    from d2export import config as config_mod, pipeline
    from d2export.exporting.onnx_export import export_onnx
    from d2export.tracing import dummy_images, torch_inputs

    start = time.perf_counter()
    cfg = config_mod.load(config, [f"export.output_dir={Path(path).parent}", f"export.sampler={sampler}",
                                   f"export.exporter={exporter}", *overrides])
    built = pipeline.prepare(cfg, ROOT)
    args = torch_inputs(built.adapter, dummy_images(cfg.export.dummy_sizes, cfg.model.seed))
    built_s = time.perf_counter() - start
    with torch.no_grad(), pipeline.export_scope(built):
        result = export_onnx(built.adapter, args, path, input_names=built.adapter.input_names,
                             output_names=built.adapter.output_names,
                             dynamic_axes=built.adapter.dynamic_axes if cfg.export.dynamic else None,
                             opset=cfg.export.opset, exporter=exporter)
    print(json.dumps({"build_s": built_s, "export_s": result.seconds, "nodes": result.node_count,
                      "peak_rss_gb": peak_rss_gb()}))


def export_in_child(config: str, sampler: str, exporter: str, path: Path, *overrides: str) -> dict:
    """The graph exported (not verified) in a child process, with Hydra `overrides`; its build and export times."""
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--export-child", config, sampler, exporter, str(path), *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"export ({sampler}, {exporter}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"child_s": time.perf_counter() - start}


# --- onnxruntime ----------------------------------------------------------------------------------------------
def session_options(threads: int, profile_prefix: str | None = None):
    import onnxruntime as ort

    from d2export.runtime.providers import serving_settings

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3  # no warnings about constant folding it skipped
    serving_settings(opts, ["CPUExecutionProvider"])  # the optimizers the runtime's own CPU sessions leave out
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return opts


def open_session(path: Path, threads: int, profile_prefix: str | None = None, cache: bool = True,
                 kernel: str | None = None):
    """A session as the runtime opens one (custom operators registered, with the fused operator's `kernel` if one
    is named; the optimized-model cache unless cache=False or profiling); returns it and the seconds it took."""
    import onnxruntime as ort

    from d2export.runtime.optimized_cache import create_session

    with custom_ops.forcing(kernel):
        options = custom_ops.register(session_options(threads, profile_prefix), custom_ops.file_ops(path))
    start = time.perf_counter()
    if cache and not profile_prefix:
        session = create_session(path, options, ["CPUExecutionProvider"])
    else:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session, time.perf_counter() - start


# --- timing ---------------------------------------------------------------------------------------------------
def interleaved(runners: dict, rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each runner (see `interleaved_rounds`)."""
    return {name: statistics.median(t) for name, t in interleaved_rounds(runners, rounds, warmup).items()}


def interleaved_rounds(runners: dict, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each call of each runner, round by round, after `warmup` calls each. Every other round runs them in
    reverse order: on 2 cores the second of two equal graphs measured 2-4% slower in every round (whatever ran before
    it leaves the caches its own), enough to invert a small difference."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    times = {name: [] for name in runners}
    for r in range(rounds):
        for name, run in (list(runners.items()) if r % 2 == 0 else list(runners.items())[::-1]):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(times: dict[str, list[float]], over: str, under: str) -> tuple[float, float, float]:
    """times[over] / times[under] round by round: the median and the range. A shared machine's speed drifts by 20%
    within a minute; runs of one round share its speed, so their ratio holds where the two medians need not."""
    ratios = [a / b for a, b in zip(times[over], times[under])]
    return statistics.median(ratios), min(ratios), max(ratios)


# --- parity ---------------------------------------------------------------------------------------------------
def parity(names, reference, outputs) -> dict:
    """Float outputs: max abs difference (control points in pixels: also the 99th percentile); integer outputs
    (labels, character ids): the fraction that agrees."""
    row = {}
    for name, ref, out in zip(names, reference, outputs):
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.dtype.kind == "f":
            diff = np.abs(ref.astype(np.float64) - out.astype(np.float64))
            row[name] = float(diff.max())
            if name == "ctrl_points":
                row["ctrl_points_p99"] = float(np.percentile(diff, 99))
        else:
            row[name + "_agree"] = float((ref == out).mean())
    return row


# --- profile --------------------------------------------------------------------------------------------------
def profile(path: Path, feed: dict, threads: int, runs: int, tmp: Path, kernel: str | None = None) -> dict:
    """Per op type and per node: ms per run over `runs` warm runs; the MSDA cores' share."""
    import onnx

    from d2export.exporting.graph_scopes import msda_scopes, node_scope

    graph = onnx.load(str(path), load_external_data=False).graph
    scopes = msda_scopes(graph)
    scope_of = {n.name: node_scope(n) for n in graph.node}
    session, _ = open_session(path, threads, str(tmp / "ort_profile"), kernel=kernel)
    for _ in range(2):  # warm-up, left out below: onnxruntime's arena still grows during the second run
        session.run(None, feed)
    for _ in range(runs):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs_ts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    first_warm = runs_ts[2] if len(runs_ts) > 2 else 0
    walls = [e["dur"] / 1e3 for e in events if e.get("name") == "model_run" and e["ts"] >= first_warm]
    by_op, by_node, msda = collections.Counter(), collections.Counter(), 0.0
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < first_warm:
            continue
        name, ms = e["name"][:-len("_kernel_time")], e["dur"] / 1e3 / runs
        by_op[e["args"]["op_name"]] += ms
        by_node[name] += ms
        scope = scope_of.get(name)
        if scope is None:  # a node onnxruntime made (fusions, layout changes): its name carries the scope
            scope = name.strip("/").rpartition("/")[0].replace("/", ".")
        if scope in scopes:
            msda += ms
    # the nodes onnxruntime really runs (its optimised graph), and the wall time of a run beside its kernels'
    return {"by_op": by_op, "by_node": by_node, "msda_ms": msda, "total_ms": sum(by_op.values()),
            "msda_calls": len(scopes), "nodes_run": len(by_node), "nodes_exported": len(graph.node),
            "wall_ms": statistics.median(walls) if walls else float("nan")}


def print_profiles(profiles: dict) -> None:
    """Every graph's profile in one table: nodes as exported and as run, wall against kernel time, the top ops."""
    print("\n## where each graph's time goes (onnxruntime profile, warm runs)")
    print(f"{'graph':40s} {'nodes':>6s} {'run':>6s} {'wall ms':>8s} {'kernel ms':>10s} {'outside':>8s}  "
          "top op types (ms)")
    for name, prof in profiles.items():
        outside = prof["wall_ms"] - prof["total_ms"]
        top = ", ".join(f"{op} {ms:.0f}" for op, ms in prof["by_op"].most_common(6))
        print(f"{name:40s} {prof['nodes_exported']:6d} {prof['nodes_run']:6d} {prof['wall_ms']:8.0f} "
              f"{prof['total_ms']:10.0f} {100 * outside / prof['wall_ms']:7.1f}%  {top}")


# --- the compute floor ----------------------------------------------------------------------------------------
def model_macs(module, args) -> float:
    """Multiply-adds of one eager call: matrix products and convolutions as torch's FLOP counter sees them, plus
    four per sampled value for bilinear grid_sample (MSDA's eager core)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    def grid_sample_flops(input_shape, grid_shape, *args, out_shape=None, **kwargs):
        n, c = input_shape[:2]
        return 2 * 4 * n * c * int(np.prod(grid_shape[1:-1]))  # counted as flops, 2 per multiply-add

    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.grid_sampler_2d: grid_sample_flops})
    # the counter's module tracker hooks module inputs that require grad, which fails under no_grad for a parameter
    # handed to a submodule as an input (Swin's and DeepSolo's code do): parameters stop requiring grad meanwhile
    needing = [p for p in module.parameters() if p.requires_grad]
    try:
        for p in needing:
            p.requires_grad_(False)
        with torch.no_grad(), counter:
            module(*args)
    finally:
        for p in needing:
            p.requires_grad_(True)
    return counter.get_total_flops() / 2


def dense_rate(threads: int) -> float:
    """The best float32 multiply-add rate this machine reaches on `threads` threads: large products (one of them
    TESTR's encoder FFN at 640²) in onnxruntime (MLAS) and in torch, the best of a few tries of each."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", "k"]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, ["k", "n"])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["m", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                   providers=["CPUExecutionProvider"])
    best = 0.0
    for m, k, n in [(4096, 1024, 1024), (8500, 256, 1024)]:
        a, b = np.random.rand(m, k).astype(np.float32), np.random.rand(k, n).astype(np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        for run in (lambda: session.run(None, {"a": a, "b": b}), lambda: torch.mm(ta, tb)):
            run()
            for _ in range(7):
                start = time.perf_counter()
                run()
                best = max(best, m * k * n / (time.perf_counter() - start))
    return best


# --- one model at one size, in a child process ---------------------------------------------------------------
def _measure_child(config: str, runner: str, size: int, threads: int, runs: int) -> None:
    """Load the model (eager: build it; else: open the graph at `runner`), run one warm-up image and `runs` timed
    ones at size²; print ms per image (median) and the process's peak RSS."""
    images_feed = None
    if runner == "eager":
        import torch

        from d2export import config as config_mod, pipeline
        from d2export.tracing import dummy_images, graph_inputs

        torch.set_num_threads(threads)
        built = pipeline.prepare(config_mod.load(config, ["export.output_dir=/tmp/d2export_e2e_unused"]), ROOT)
        images_feed = graph_inputs(built.adapter, dummy_images([(size, size)], seed=123))
        args = tuple(torch.from_numpy(images_feed[n]) for n in built.adapter.input_names)

        def run():
            with torch.no_grad():
                built.adapter(*args)
    else:
        from d2export.resizing import pad_batch

        session, _ = open_session(Path(runner), threads)
        rng = np.random.default_rng(123)
        images, sizes = pad_batch([rng.integers(0, 256, (3, size, size), dtype=np.uint8)])
        feed = {"images": images, "image_sizes": sizes.astype(np.int64)}

        def run():
            session.run(None, feed)
    run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": 1e3 * statistics.median(times),
                      "peak_rss_gb": peak_rss_gb()}))


def measure_in_child(config: str, runner: str, size: int, threads: int, runs: int, kernel: str | None = None) -> dict:

    cmd = [sys.executable, "-m", "benchmarks.e2e", "--measure-child", config, runner, str(size), str(threads),
           str(runs)]
    with custom_ops.forcing(kernel):  # the child inherits it
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        return {"ms": float("nan"), "peak_rss_gb": float("nan"), "error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(rows: dict, path: Path, title: str) -> None:
    """ms per image and peak RSS against image size, one line per runner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_size in rows.items():
        sizes = sorted(by_size)
        left.plot(sizes, [by_size[s]["ms"] / 1e3 for s in sizes], marker="o", label=name)
        right.plot(sizes, [by_size[s]["peak_rss_gb"] for s in sizes], marker="o", label=name)
    left.set(xlabel="image size (square, px)", ylabel="seconds per image", yscale="log", title="latency")
    right.set(xlabel="image size (square, px)", ylabel="peak RSS (GB)", title="peak memory of the process")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# --- main -----------------------------------------------------------------------------------------------------
def main(argv=None):
    p = parser("benchmark.py e2e", __doc__.split("\n")[0])
    p.add_argument("--config", default="textdet", help="export config (default textdet: TESTR R-50)")
    p.add_argument("--size", type=int, default=640, help="image size (square) of the interleaved timing")
    p.add_argument("--threads", type=int, default=2, help="torch and onnxruntime intra-op threads")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--samplers", nargs="+", default=["gather", "fused"], help="graphs to export (export.sampler)")
    p.add_argument("--sizes", type=int, nargs="*", default=[320, 640, 1024, 1600],
                   help="sizes of the per-size table (none: skip it)")
    p.add_argument("--size-runs", type=int, default=2, help="timed images per size after a warm-up one")
    p.add_argument("--plot", help="write the per-size figure here (PNG; default: no figure)")
    p.add_argument("--dynamo", action="store_true", help="also export each sampler with torch.export")
    p.add_argument("--fp16", action="store_true", help="also a float16 copy of the first graph, with its parity")
    p.add_argument("--int8", nargs="*", default=[], choices=["dynamic", "static"],
                   help="also int8 copies of every graph (export.int8's quantisation), timed beside them")
    p.add_argument("--calibration", help="int8 static: a folder of pictures (default: 8 `d2export synth text` "
                   "pictures of a seed of their own, at --size)")
    p.add_argument("--profile-runs", type=int, default=2, help="onnxruntime profiled runs per graph")
    p.add_argument("--out", help="keep the exported graphs here (default: a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="reuse graphs already in --out instead of exporting")
    p.add_argument("--export-child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--measure-child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.export_child:
        return _export_child(*args.export_child)
    if args.measure_child:
        config, runner, size, threads, runs = args.measure_child
        return _measure_child(config, runner, int(size), int(threads), int(runs))

    import onnxruntime
    import torch

    torch.set_num_threads(args.threads)
    tmp_holder = None if args.out else tempfile.TemporaryDirectory(prefix="d2export_e2e_")
    out = Path(args.out or tmp_holder.name)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"config {args.config}, batch 1, {args.threads} thread(s) both sides; torch {torch.__version__}, "
              f"onnxruntime {onnxruntime.__version__}, {_cpu()}, load average at start {os.getloadavg()[0]:.1f}")
    print(f"# d2export end-to-end: {header}")

    variants = [(s, e) for s in args.samplers for e in ("torchscript", "dynamo")[:1 + args.dynamo]]
    exports, sessions = {}, {}
    print("\n## export (fresh child process each; dummy size from the config, dynamic H/W) and session creation")
    print(f"{'graph':24s} {'nodes':>6s} {'export s':>9s} {'peak RSS GB':>12s} {'session s: no cache':>20s} "
          f"{'first':>6s} {'cached':>7s}")
    for sampler, exporter in variants:
        name = f"ORT {sampler}" + (" (dynamo)" if exporter == "dynamo" else "")
        path = out / f"{sampler}_{exporter}.onnx"
        if args.reuse and path.is_file():
            import onnx

            info = {"nodes": len(onnx.load(str(path), load_external_data=False).graph.node), "export_s": float("nan"),
                    "peak_rss_gb": float("nan")}
        else:
            info = export_in_child(args.config, sampler, exporter, path)
        for stale in path.parent.glob(f".{path.name}.ort-cache/*"):
            stale.unlink()
        _, info["plain_s"] = open_session(path, args.threads, cache=False)
        _, info["first_s"] = open_session(path, args.threads)
        sessions[name], info["session_s"] = open_session(path, args.threads)
        exports[name] = info | {"path": path}
        print(f"{name:24s} {info['nodes']:6d} {info['export_s']:9.1f} {info['peak_rss_gb']:12.2f} "
              f"{info['plain_s']:20.1f} {info['first_s']:6.1f} {info['session_s']:7.1f}")
        if sampler == "fused" and custom_ops.kernel().name == "native":  # the same graph on the fallback kernel
            sessions[f"{name} (numba kernel)"], _ = open_session(path, args.threads, kernel="numba")
            exports[f"{name} (numba kernel)"] = {"path": path, "kernel": "numba"}

    # the eager model, as a user runs it: MSDA swapped for the core, which eagerly is per-level grid_sample
    from d2export import config as config_mod, pipeline
    from d2export.tracing import dummy_images, graph_inputs

    cfg = config_mod.load(args.config, [f"export.output_dir={out}"])
    built = pipeline.prepare(cfg, ROOT)
    feed = graph_inputs(built.adapter, dummy_images([(args.size, args.size)], seed=123))
    torch_args = tuple(torch.from_numpy(feed[n]) for n in built.adapter.input_names)
    output_names = list(built.adapter.output_names)

    def eager():
        with torch.no_grad():
            return [t.numpy() for t in built.adapter(*torch_args)]

    if args.int8:
        sessions.update(int8_sessions(args.int8, exports, built, out, args.threads, args.size, args.calibration))

    runners = {EAGER: eager}
    runners.update({name: (lambda s=s: s.run(output_names, feed)) for name, s in sessions.items()})
    reference = eager()
    parities = {name: parity(output_names, reference, s.run(output_names, feed)) for name, s in sessions.items()}
    times = interleaved_rounds(runners, args.rounds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians[EAGER]
    print(f"\n## latency, {args.size}x{args.size}, batch 1 (median of {args.rounds} interleaved rounds, warm; "
          f"speed-up: the median of each round's own ratio; load average now {os.getloadavg()[0]:.1f})")
    print(f"{'runner':40s} {'ms':>8s} {'speed-up':>9s}   parity vs eager (max abs; char ids agreeing)")
    for name, sec in medians.items():
        par = parities.get(name)
        par_s = "" if par is None else (f"scores {par['scores']:.1e}, points {par['ctrl_points']:.1e} px, "
                                         f"chars {par['char_ids_agree']:.3f}")
        print(f"{name:40s} {1e3 * sec:8.0f} {paired_ratio(times, EAGER, name)[0]:8.2f}x   {par_s}")
    macs, rate = model_macs(built.adapter, torch_args), dense_rate(args.threads)
    floor = macs / rate
    print(f"\n## compute floor at {args.size}x{args.size}: {macs / 1e9:.1f} G multiply-adds per image (matrix "
          f"products, convolutions, bilinear sampling), at the best float32 rate measured here on {args.threads} "
          f"thread(s), {rate / 1e9:.1f} G/s: {1e3 * floor:.0f} ms. No float32 graph on this machine can beat eager "
          f"by more than {base / floor:.2f}x.")
    for name, sec in medians.items():
        print(f"{name:40s} {sec / floor:6.2f}x the floor")
    del built, runners  # the per-size children below need the memory

    if args.sizes:
        rows = {EAGER: {}} | {name: {} for name in sessions}
        where = {EAGER: "eager"} | {name: str(exports[name]["path"]) for name in sessions}
        for size in args.sizes:
            for name in rows:
                rows[name][size] = measure_in_child(args.config, where[name], size, args.threads, args.size_runs,
                                                    exports.get(name, {}).get("kernel"))
        print(f"\n## per image size: ms per image (median of {args.size_runs} after a warm-up) and the peak RSS of "
              f"a fresh process that loads the model and runs it (load average now {os.getloadavg()[0]:.1f})")
        print(f"{'runner':40s} " + " ".join(f"{f'{s}² ms':>9s} {'GB':>5s}" for s in args.sizes))
        for name, by_size in rows.items():
            print(f"{name:40s} " + " ".join(f"{by_size[s]['ms']:9.0f} {by_size[s]['peak_rss_gb']:5.2f}"
                                            for s in args.sizes))
        for name, by_size in rows.items():
            for size, row in by_size.items():
                if "error" in row:
                    print(f"  {name} at {size}²: {row['error']}")
        if args.plot:
            plot(rows, Path(args.plot), header)

    first = next(iter(sessions))
    if args.profile_runs < 1:
        print("\n(no onnxruntime profile: --profile-runs 0)")
    else:
        profiles = {name: profile(exports[name]["path"], feed, args.threads, args.profile_runs, out,
                                  exports[name].get("kernel")) for name in sessions}
        print_profiles(profiles)
        print_profile(first, profiles[first], args.profile_runs)

    if args.fp16:
        import onnx

        from d2export.exporting.fp16 import to_float16

        src = exports[first]["path"]
        half_path = out / (src.stem + "_fp16.onnx")
        onnx.save(to_float16(onnx.load(str(src))), str(half_path))
        half, _ = open_session(half_path, args.threads, cache=False)
        par = parity(output_names, reference, half.run(output_names, feed))
        print(f"\n## float16 copy of '{first}': parity vs float32 eager")
        print("  " + ", ".join(f"{k} {v:.3g}" for k, v in par.items()))


def int8_sessions(modes, exports: dict, built, out: Path, threads: int, size: int, calibration: str | None) -> dict:
    """An int8 copy of every exported graph per mode, quantised as `export.int8` does (the family's float scopes,
    reduce_range from the CPU), opened for timing: {"<graph> int8 <mode>": session}."""
    from d2export.cpu import cpu_features
    from d2export.datasets import generate
    from d2export.exporting import int8
    from d2export.verification.pictures import picture_files
    from d2export.resizing import resize_shortest_edge

    folder = Path(calibration) if calibration else out / "calibration"
    if "static" in modes and not calibration and not (folder / "annotations.json").is_file():
        generate("text", folder, count=8, seed=11, size=(size, size), workers=1)

    def feeds(picture):
        chw = resize_shortest_edge(picture[:, :, ::-1].copy(), size, 10 * size).transpose(2, 0, 1)  # BGR, as built
        return built.adapter.graph_inputs([np.ascontiguousarray(chw)])

    found = {}
    for name, info in [(n, i) for n, i in exports.items() if "kernel" not in i]:  # each graph once
        for mode in modes:
            path = out / f"{info['path'].stem}_int8_{mode}.onnx"
            pictures = int8.Pictures(picture_files(str(folder), 8), feeds) if mode == "static" else None
            try:
                record = int8.quantize(info["path"], path, mode, built.family.int8_float_scopes, cpu_features(),
                                       pictures, static_ops=built.family.int8_static_ops)
            except Exception as e:  # noqa: BLE001 - a graph the tooling cannot take is a row that says so
                print(f"{name} int8 {mode}: not quantised: {str(e).splitlines()[0][:200]}")
                continue
            print(f"{name} int8 {mode}: {record.quantized} nodes int8, {len(record.kept_float)} kept float; "
                  f"{record.why_reduce_range}")
            found[f"{name} int8 {mode}"], _ = open_session(path, threads, cache=False)
            exports[f"{name} int8 {mode}"] = {"path": path}  # the per-size children load it from there
    return found


def print_profile(name: str, prof: dict, runs: int) -> None:
    """`profile`'s figures for graph `name`: time per op type and per node, and the MSDA cores' share."""
    total = prof["total_ms"]
    print(f"\n## onnxruntime profile of '{name}' ({runs} warm runs; kernel time {total:.0f} ms/run)")
    print("op type              ms/run  share")
    for op, ms in prof["by_op"].most_common(12):
        print(f"{op:18s} {ms:8.1f}  {100 * ms / total:5.1f}%")
    print("\ntop nodes                                                                  ms/run")
    for node, ms in prof["by_node"].most_common(12):
        print(f"{node[-72:]:72s} {ms:8.1f}")
    print(f"\nMSDA sampling cores ({prof['msda_calls']} calls: locations, weights, Gather, MatMul; projections "
          f"excluded): {prof['msda_ms']:.0f} ms/run = {100 * prof['msda_ms'] / total:.0f}% of kernel time")


def _cpu() -> str:
    from d2export.cpu import describe_cpu

    return describe_cpu()


if __name__ == "__main__":
    main()
