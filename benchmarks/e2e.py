"""End-to-end benchmark: the exported text spotter in onnxruntime against the PyTorch model it came from.

    .venv/bin/python tools/benchmark.py e2e [--config textdet] [--size 640] [--threads 2] [--rounds 5]
        [--samplers gather grid_sample] [--dynamo] [--no-fp16] [--out DIR]

One run, one machine, in this order:
1. export: each sampler in a fresh child process (the config's dummy size, dynamic H/W), timed (model build and
   export separately) with the child's peak RSS; then onnxruntime session creation (ORT_ENABLE_ALL), timed;
2. latency at --size², batch 1: the model as a user runs it today on a CPU (eager PyTorch, MSDA swapped for the
   per-level grid_sample core) against every exported graph on onnxruntime's CPU provider, the same explicit
   thread count on both sides; all warmed up, then timed in interleaved rounds; medians and ratios;
3. parity of every graph against eager on that image;
4. an onnxruntime profile of the first sampler's graph (warm runs only): time per op type, the MSDA sampling
   cores' share, the top nodes, and MSDA's time against the memory-traffic floor in ../shared/facts.md;
5. a float16 copy of the first graph (weights and activations float16, MSDA sampling and Softmax float32):
   its parity against eager (on the CPU only parity is meaningful; float16 is for GPU serving).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GOAL_SPEEDUP, GOAL_EXPORT_S, GOAL_RSS_GB, GOAL_SESSION_S = 3.0, 60.0, 4.0, 3.0
# facts.md: all MSDA calls of one 640² image move enough memory for ~50-100 ms on 2 cores
MSDA_FLOOR_MS = (50.0, 100.0)


# --- export, in a child process -------------------------------------------------------------------------------
def _export_child(config: str, sampler: str, exporter: str, path: str) -> None:
    import torch

    from d2export import config as config_mod, pipeline
    from d2export.exporting.onnx_export import export_onnx

    start = time.perf_counter()
    cfg = config_mod.load(config, [f"export.output_dir={Path(path).parent}", f"export.sampler={sampler}",
                                   f"export.exporter={exporter}"])
    built = pipeline.prepare(cfg, ROOT)
    args = pipeline._torch_inputs(built.adapter, pipeline.dummy_images(cfg.export.dummy_sizes, cfg.model.seed))
    built_s = time.perf_counter() - start
    with torch.no_grad(), pipeline.export_scope(built):
        result = export_onnx(built.adapter, args, path, input_names=built.adapter.input_names,
                             output_names=built.adapter.output_names, dynamic_axes=built.adapter.dynamic_axes,
                             opset=cfg.export.opset, exporter=exporter)
    print(json.dumps({"build_s": built_s, "export_s": result.seconds, "nodes": result.node_count,
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def export_in_child(config: str, sampler: str, exporter: str, path: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--export-child", config, sampler, exporter, str(path)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"export ({sampler}, {exporter}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"child_s": time.perf_counter() - start}


# --- onnxruntime ----------------------------------------------------------------------------------------------
def session_options(threads: int, profile_prefix: str | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3  # no warnings about constant folding it skipped
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return opts


def open_session(path: Path, threads: int, profile_prefix: str | None = None):
    import onnxruntime as ort

    start = time.perf_counter()
    session = ort.InferenceSession(str(path), session_options(threads, profile_prefix),
                                   providers=["CPUExecutionProvider"])
    return session, time.perf_counter() - start


# --- timing ---------------------------------------------------------------------------------------------------
def interleaved(runners: dict, rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each runner, timed in interleaved rounds after `warmup` calls each."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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
def profile(path: Path, feed: dict, threads: int, runs: int, tmp: Path) -> dict:
    """Per op type and per node: ms per run over `runs` warm runs; the MSDA cores' share."""
    import onnx

    from d2export.exporting.graph_scopes import msda_scopes, node_scope

    graph = onnx.load(str(path), load_external_data=False).graph
    scopes = msda_scopes(graph)
    scope_of = {n.name: node_scope(n) for n in graph.node}
    session, _ = open_session(path, threads, str(tmp / "ort_profile"))
    for _ in range(2):  # warm-up, left out below: onnxruntime's arena still grows during the second run
        session.run(None, feed)
    for _ in range(runs):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs_ts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    first_warm = runs_ts[2] if len(runs_ts) > 2 else 0
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
    return {"by_op": by_op, "by_node": by_node, "msda_ms": msda, "total_ms": sum(by_op.values()),
            "msda_calls": len(scopes)}


# --- main -----------------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="textdet")
    p.add_argument("--size", type=int, default=640, help="timed image size (square), batch 1")
    p.add_argument("--threads", type=int, default=2, help="torch and onnxruntime intra-op threads")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samplers", nargs="+", default=["gather", "grid_sample"])
    p.add_argument("--dynamo", action="store_true", help="also export the first sampler with torch.export")
    p.add_argument("--no-fp16", action="store_true")
    p.add_argument("--profile-runs", type=int, default=2)
    p.add_argument("--out", help="keep the exported graphs here (default: a temporary directory)")
    p.add_argument("--export-child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.export_child:
        return _export_child(*args.export_child)

    import onnxruntime
    import torch

    torch.set_num_threads(args.threads)
    tmp_holder = None if args.out else tempfile.TemporaryDirectory(prefix="d2export_e2e_")
    out = Path(args.out or tmp_holder.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# d2export end-to-end: config {args.config}, {args.size}x{args.size}, batch 1, {args.threads} thread(s) "
          f"both sides, {args.rounds} rounds\n# torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"{_cpu()}, load average at start {os.getloadavg()[0]:.1f}")

    variants = [(s, "torchscript") for s in args.samplers] + ([(args.samplers[0], "dynamo")] if args.dynamo else [])
    exports, sessions = {}, {}
    print("\n## export (fresh child process each; dummy size from the config, dynamic H/W)")
    print(f"{'graph':28s} {'nodes':>6s} {'build s':>8s} {'export s':>9s} {'peak RSS GB':>12s} {'session s':>10s}")
    for sampler, exporter in variants:
        name = f"ORT {sampler}" + (" (dynamo)" if exporter == "dynamo" else "")
        path = out / f"{sampler}_{exporter}.onnx"
        info = export_in_child(args.config, sampler, exporter, path)
        sessions[name], info["session_s"] = open_session(path, args.threads)
        exports[name] = info | {"path": path}
        print(f"{name:28s} {info['nodes']:6d} {info['build_s']:8.1f} {info['export_s']:9.1f} "
              f"{info['peak_rss_gb']:12.2f} {info['session_s']:10.1f}")
    worst = {k: max(e[k] for e in exports.values()) for k in ("export_s", "peak_rss_gb", "session_s")}
    print(f"goals: export <= {GOAL_EXPORT_S:.0f} s: {_verdict(worst['export_s'] <= GOAL_EXPORT_S)}; "
          f"peak RSS <= {GOAL_RSS_GB:.0f} GB: {_verdict(worst['peak_rss_gb'] <= GOAL_RSS_GB)}; "
          f"session <= {GOAL_SESSION_S:.0f} s: {_verdict(worst['session_s'] <= GOAL_SESSION_S)}")

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

    runners = {"eager PyTorch (per-level grid_sample)": eager}
    runners.update({name: (lambda s=s: s.run(output_names, feed)) for name, s in sessions.items()})
    reference = eager()
    parities = {name: parity(output_names, reference, s.run(output_names, feed)) for name, s in sessions.items()}
    medians = interleaved(runners, args.rounds)
    base = medians["eager PyTorch (per-level grid_sample)"]
    print(f"\n## latency, {args.size}x{args.size}, batch 1 (median of {args.rounds} interleaved rounds, warm)")
    print(f"{'runner':40s} {'ms':>8s} {'speed-up':>9s}   parity vs eager (max abs; char ids agreeing)")
    for name, sec in medians.items():
        ratio = base / sec
        verdict = "" if name not in sessions else f" {_verdict(ratio >= GOAL_SPEEDUP)}"
        par = parities.get(name)
        par_s = "" if par is None else (f"scores {par['scores']:.1e}, points {par['ctrl_points']:.1e} px, "
                                         f"chars {par['char_ids_agree']:.3f}")
        print(f"{name:40s} {1e3 * sec:8.0f} {ratio:8.2f}x{verdict:>8s}   {par_s}")
    print(f"goal: onnxruntime >= {GOAL_SPEEDUP:.0f}x faster than eager")

    first = next(iter(sessions))
    prof = profile(exports[first]["path"], feed, args.threads, args.profile_runs, out)
    total = prof["total_ms"]
    print(f"\n## onnxruntime profile of '{first}' ({args.profile_runs} warm runs; kernel time {total:.0f} ms/run)")
    print("op type              ms/run  share")
    for op, ms in prof["by_op"].most_common(12):
        print(f"{op:18s} {ms:8.1f}  {100 * ms / total:5.1f}%")
    print("\ntop nodes                                                                  ms/run")
    for node, ms in prof["by_node"].most_common(12):
        print(f"{node[-72:]:72s} {ms:8.1f}")
    lo, hi = MSDA_FLOOR_MS
    print(f"\nMSDA sampling cores ({prof['msda_calls']} calls: locations, weights, Gather, MatMul; projections "
          f"excluded): {prof['msda_ms']:.0f} ms/run = {100 * prof['msda_ms'] / total:.0f}% of kernel time; "
          f"{prof['msda_ms'] / hi:.1f}-{prof['msda_ms'] / lo:.1f}x the memory-traffic floor ({lo:.0f}-{hi:.0f} ms)")

    if not args.no_fp16:
        import onnx

        from d2export.exporting.fp16 import to_float16

        src = exports[first]["path"]
        half_path = out / (src.stem + "_fp16.onnx")
        start = time.perf_counter()
        onnx.save(to_float16(onnx.load(str(src))), str(half_path))
        convert_s = time.perf_counter() - start
        half, session_s = open_session(half_path, args.threads)
        par = parity(output_names, reference, half.run(output_names, feed))
        fp32_mb, fp16_mb = src.stat().st_size / 1e6, half_path.stat().st_size / 1e6
        print(f"\n## float16 copy of '{first}' (MSDA sampling and Softmax float32; {convert_s:.1f} s to convert, "
              f"{fp32_mb:.0f} -> {fp16_mb:.0f} MB, session {session_s:.1f} s): parity vs float32 eager")
        print("  " + ", ".join(f"{k} {v:.3g}" for k, v in par.items()))
        print("  (CPU: onnxruntime computes most float16 ops through inserted casts; time it on a GPU)")


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _cpu() -> str:
    try:
        model = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} logical CPUs"


if __name__ == "__main__":
    main()
