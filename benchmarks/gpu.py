"""GPU benchmark: the text spotter on one NVIDIA GPU, eager PyTorch against onnxruntime's CUDA provider.

    python tools/benchmark.py gpu [--config textdet] [--model GRAPH.onnx] [--size 640] [--batches 1 8]
        [--rounds 20] [--upstream-msda DIR] [--simplified] [--out DIR] [--json FILE]

Rows, each at every batch size (the same pictures, --size², in every row):
- eager PyTorch with the compiled MSDA kernel the user has (--upstream-msda: a folder holding Deformable-DETR's
  `src/` — vision.cpp, cpu/, cuda/ — built here with torch's cpp_extension for this GPU only), the model's own
  forward (`plugin.swap_msda=false`) calling it through the configured `plugin.compiled_ops` names;
- eager PyTorch with the plugin (MSDA swapped for d2export's core, as `d2export export` builds it);
- onnxruntime's CUDA provider on the float32 graph and on its float16 copy, each fed from the host (`run`, as the
  Predictor does) and with IO binding (inputs and outputs stay on the GPU), TF32 off as verified; with --simplified
  also the float32 graph through onnxslim (`export.simplify=true`).
For each: wall time per call and per picture (medians, after 2 s of warm-up calls); what one call runs on the GPU
(torch's profiler, whose CUPTI tracing sees onnxruntime's kernels too: kernels and their summed time, copies to the
device, the span from first to last, so the GPU's idle share); for eager also CUDA events around the call; peak GPU
memory (PyTorch: its allocator's peak; onnxruntime: what the process holds on the GPU beyond what it held before the
session, read through NVML); and, for the graphs, the nodes onnxruntime placed on the CPU and the host<->device copies
it inserted (Memcpy nodes run per call), from its profile.
Then parity at batch 1: the CUDA provider's float32 outputs, slot by slot, against the same graph on the CPU provider
(the graph `d2export export` verified). TF32 is off everywhere (its 10-bit mantissa reorders near-tied proposals).

The serving route (unless --no-fused): per batch size a fixed-size graph with the fused MSDA operator
(`export.sampler=fused export.dynamic=false`, which onnxruntime folds to no host arithmetic) and its float16 copy,
each run as the Predictor does and replaying a CUDA graph (`d2export.runtime.bound_runs`, `--cuda-graph`); what
`host_copies.census` predicts and the Memcpy nodes onnxruntime really inserted; eager also under autocast float16;
the fused graph's parity with the CPU provider; and the ratios the serving goals are stated in.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import parity
from d2export.commandline import parser

ROOT = Path(__file__).resolve().parent.parent


# --- the compiled kernel a user has ---------------------------------------------------------------------------
# what current torch no longer compiles in Deformable-DETR's 2020 sources, and what users change it to
_TORCH2_FIXES = ((re.compile(r"(\w+)\.type\(\)\.is_cuda\(\)"), r"\1.is_cuda()"),
                 (re.compile(r"(AT_DISPATCH_\w+\(\s*\w+)\.type\(\)"), r"\1.scalar_type()"))


def torch2_sources(src: Path, dest: Path) -> list[Path]:
    """A copy of the extension's sources under `dest`, with the two changes torch 2 needs (`x.type().is_cuda()` and
    dispatch on `x.type()` are gone); returns the files to compile."""
    files = []
    for path in sorted(p for p in src.rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh")):
        text = path.read_text()
        for pattern, replacement in _TORCH2_FIXES:
            text = pattern.sub(replacement, text)
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        if path.suffix in (".cpp", ".cu"):
            files.append(target)
    return files


def build_upstream(folder: Path, build_dir: Path):
    """Deformable-DETR's MSDA extension (`MultiScaleDeformableAttention`), built for this GPU's architecture only."""
    import torch
    from torch.utils.cpp_extension import load

    src = folder / "src" if (folder / "src").is_dir() else folder
    sources = torch2_sources(src, build_dir / "src")
    if not sources:
        raise FileNotFoundError(f"--upstream-msda {folder}: no .cpp/.cu sources under it")
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    start = time.perf_counter()
    ext = load("MultiScaleDeformableAttention", [str(s) for s in sources], extra_include_paths=[str(build_dir / "src")],
               build_directory=str(build_dir), extra_cflags=["-O3", "-DWITH_CUDA"],
               extra_cuda_cflags=["-O3", "-DCUDA_HAS_FP16=1", "-D__CUDA_NO_HALF_OPERATORS__",
                                  "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"], verbose=False)
    print(f"upstream MSDA extension built for sm_{major}{minor} in {time.perf_counter() - start:.0f} s")
    return ext


def warm_up(call, seconds: float = 2.0, least: int = 3) -> None:
    """Calls until `seconds` have passed (and at least `least`): an idle GPU's clocks take that long to rise (the
    first row of a run measured 23% slower after three calls alone)."""
    import torch

    start, done = time.perf_counter(), 0
    while done < least or time.perf_counter() - start < seconds:
        call()
        torch.cuda.synchronize()
        done += 1


# --- eager ----------------------------------------------------------------------------------------------------
def eager_model(config: str, out: Path, swap: bool):
    from d2export import config as config_mod, pipeline

    overrides = [f"export.output_dir={out}", "export.device=cuda", f"plugin.swap_msda={str(swap).lower()}"]
    return pipeline.prepare(config_mod.load(config, overrides), ROOT)


def eager_call(adapter, args, autocast: bool = False):
    """One forward; `autocast`: under torch.autocast float16, as a PyTorch user serves in half precision."""
    import torch

    def call():
        with torch.no_grad(), torch.autocast("cuda", torch.float16, enabled=autocast):
            return adapter(*args)
    return call


def time_eager(call, rounds: int, batch: int) -> dict:
    import torch

    warm_up(call)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    gpu, wall = [], []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        call()
        end.record()
        torch.cuda.synchronize()
        wall.append(1e3 * (time.perf_counter() - start))
        gpu.append(begin.elapsed_time(end))
    return {"gpu_ms": statistics.median(gpu), "wall_ms": statistics.median(wall),
            "per_picture_ms": statistics.median(wall) / batch,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30}


def gpu_activity(trace: dict) -> dict:
    """What ran on the GPU, from a Chrome trace of torch's profiler (CUPTI records every library's kernels in the
    process, onnxruntime's too): kernels and their summed time, host-to-device and other copies, and the span from the
    first GPU activity to the last (the span less the kernels' time is the GPU waiting on the host)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return {"kernels": 0, "kernel_ms": 0.0, "copies_to_device": 0, "copies_other": 0, "gpu_span_ms": 0.0}
    kernels = [e for e in events if e["cat"] == "kernel"]
    copies = [e for e in events if e["cat"] == "gpu_memcpy"]
    to_device = sum("HtoD" in e.get("name", "") for e in copies)
    return {"kernels": len(kernels), "kernel_ms": sum(e["dur"] for e in kernels) / 1e3,
            "copies_to_device": to_device, "copies_other": len(copies) - to_device,
            "gpu_span_ms": (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3}


def traced_gpu_activity(call, tmp: Path) -> dict:
    """`gpu_activity` of one warm call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    path = tmp / "gpu_trace.json"
    prof.export_chrome_trace(str(path))
    return gpu_activity(json.loads(path.read_text()))


# --- onnxruntime ----------------------------------------------------------------------------------------------
def process_gpu_gb() -> float:
    """What this process holds on GPU 0, as the driver counts it (NVML); nan where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return (proc.usedGpuMemory or 0) / 2**30
        return 0.0
    except Exception:  # noqa: BLE001 - a figure we cannot read is reported as missing
        return float("nan")


def cuda_session(path: Path, profile_prefix: str | None = None, cuda_graph: bool = False):
    import onnxruntime as ort

    from d2export.exporting.sessions import session_options

    opts = session_options(path)  # the fused operator's library registered where the graph has it
    opts.log_severity_level = 3
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    cuda = {"use_tf32": "0"} | ({"enable_cuda_graph": "1"} if cuda_graph else {})
    session = ort.InferenceSession(str(path), opts, providers=[("CUDAExecutionProvider", cuda),
                                                                "CPUExecutionProvider"])
    if session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"onnxruntime did not take the CUDA provider (it runs {session.get_providers()})")
    return session


def bound_runner(session, feed: dict):
    """IO binding: the inputs copied to the GPU once, the outputs left there."""
    import onnxruntime as ort

    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda", 0)

    def run():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
    return run


def time_calls(run, rounds: int, batch: int) -> dict:
    warm_up(run)
    wall = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        wall.append(1e3 * (time.perf_counter() - start))
    return {"wall_ms": statistics.median(wall), "per_picture_ms": statistics.median(wall) / batch}


def placement(path: Path, feed: dict, tmp: Path) -> dict:
    """From one profiled warm run on the CUDA provider: nodes per provider, Memcpy nodes (host<->device copies) run,
    the CPU-placed op types and the time spent running them."""
    session = cuda_session(path, str(tmp / "gpu_profile"))
    for _ in range(3):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    last = max(e["ts"] for e in events if e.get("name") == "model_run")
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= last]
    by_provider = collections.Counter(e["args"].get("provider", "?") for e in nodes)
    copies = collections.Counter(e["args"]["op_name"] for e in nodes if e["args"]["op_name"].startswith("Memcpy"))
    on_cpu = collections.Counter(e["args"]["op_name"] for e in nodes
                                 if e["args"].get("provider") == "CPUExecutionProvider")
    cpu_ms = sum(e["dur"] for e in nodes if e["args"].get("provider") == "CPUExecutionProvider") / 1e3
    return {"nodes": dict(by_provider), "copies": sum(copies.values()), "copies_by_kind": dict(copies),
            "cpu_ops": dict(on_cpu.most_common(8)), "cpu_nodes_ms": cpu_ms}


def timed_row(rows: dict, label: str, batch: int, run, rounds: int, out: Path, before_gb: float) -> None:
    """One onnxruntime row at one batch: wall times, the GPU memory the session added, one traced call."""
    row = guarded(f"{label} batch {batch}", time_calls, run, rounds, batch)
    row["process_gpu_gb"] = process_gpu_gb() - before_gb
    row.update(guarded(f"{label} GPU trace", traced_gpu_activity, run, out))
    rows.setdefault(label, {})[batch] = row
    print(f"{label:40s} batch {batch}: {row}", flush=True)


def guarded(label: str, fn, *args, **kwargs):
    """Run one row; a row that fails says why and the others go on."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        print(f"  {label}: failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}",
              flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:500]}


# --- main -----------------------------------------------------------------------------------------------------
def main(argv=None):
    p = parser("benchmark.py gpu", __doc__.split("\n")[0])
    p.add_argument("--config", default="textdet", help="export config (default textdet: TESTR R-50)")
    p.add_argument("--model", help="the float32 graph (default: export the config's gather graph into --out)")
    p.add_argument("--size", type=int, default=640, help="picture size (square)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    p.add_argument("--rounds", type=int, default=20, help="timed calls per row after 2 s of warm-up calls")
    p.add_argument("--upstream-msda", help="a folder with Deformable-DETR's MSDA sources (models/ops or its src/)")
    p.add_argument("--out", help="graphs, builds and profiles go here (default: a temporary directory)")
    p.add_argument("--simplified", action="store_true", help="also the float32 graph through onnxslim (as "
                   "export.simplify=true writes it): its placement, copies and time")
    p.add_argument("--json", help="also write every figure here")
    p.add_argument("--no-fused", dest="fused", action="store_false",
                   help="skip the fixed-size fused graphs (float32, float16, with and without CUDA graphs)")
    args = p.parse_args(argv)

    import onnxruntime as ort
    import torch

    if not torch.cuda.is_available():
        print("benchmark.py gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    holder = None if args.out else tempfile.TemporaryDirectory(prefix="d2export_gpu_")
    out = Path(args.out or holder.name)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    print(f"# d2export GPU benchmark: {props.name} ({props.total_memory / 2**30:.0f} GiB), "
          f"driver CUDA {torch.version.cuda}, torch {torch.__version__}, onnxruntime {ort.__version__}, "
          f"config {args.config}, {args.size}², TF32 off", flush=True)
    results: dict = {"device": props.name, "torch": torch.__version__, "onnxruntime": ort.__version__,
                     "size": args.size, "rows": {}}

    # graphs: float32 (given or exported here) and its float16 copy
    from d2export.exporting.fp16 import to_float16
    from d2export.tracing import dummy_images

    graph = Path(args.model) if args.model else out / "gather.onnx"
    if not args.model:
        from benchmarks.e2e import export_in_child

        info = export_in_child(args.config, "gather", "torchscript", graph)
        print(f"exported {graph} in {info['export_s']:.0f} s ({info['nodes']} nodes)", flush=True)
    import onnx

    half = out / (graph.stem + "_fp16.onnx")
    onnx.save(to_float16(onnx.load(str(graph))), str(half))
    graphs = [("float32", graph, (False, True)), ("float16", half, (False, True))]
    if args.simplified:  # export.simplify=true: onnxslim folds shape arithmetic that the CUDA provider runs on the CPU
        import onnxslim

        slim = out / (graph.stem + "_slim.onnx")
        onnx.save(onnxslim.slim(onnx.load(str(graph))), str(slim))
        graphs.append(("float32 onnxslim", slim, (False,)))

    ext = guarded("upstream MSDA build", build_upstream, Path(args.upstream_msda), out / "msda_build") \
        if args.upstream_msda else None
    rows = results["rows"]
    models = {}
    if ext is not None and not isinstance(ext, dict):  # built (a failed build is a row that says why)
        from d2export import config as config_mod

        for name in config_mod.load(args.config, [f"export.output_dir={out}"]).plugin.compiled_ops:
            sys.modules[name] = ext  # what the user's `from adet import _C` finds where they built it
        models["eager, compiled MSDA kernel"] = False
    elif isinstance(ext, dict):
        rows["eager, compiled MSDA kernel"] = ext
    models["eager, d2export plugin"] = True

    pictures = dummy_images([(args.size, args.size)] * max(args.batches), seed=123)
    adapter_for_inputs = None
    for label, swap in models.items():
        built = guarded(label, eager_model, args.config, out, swap)
        if isinstance(built, dict):
            rows[label] = built
            continue
        adapter_for_inputs = adapter_for_inputs or built.adapter
        for batch in args.batches:
            feed = built.adapter.graph_inputs(pictures[:batch])
            inputs = tuple(torch.from_numpy(feed[n]).cuda() for n in built.adapter.input_names)
            for name, autocast in ((label, False), (label + ", autocast float16", True)):
                call = eager_call(built.adapter, inputs, autocast)
                row = guarded(f"{name} batch {batch}", time_eager, call, args.rounds, batch)
                row.update(guarded(f"{name} GPU trace", traced_gpu_activity, call, out))
                rows.setdefault(name, {})[batch] = row
                print(f"{name:40s} batch {batch}: {row}", flush=True)
        del built
        torch.cuda.empty_cache()

    if adapter_for_inputs is None:
        print("benchmark.py gpu: the model could not be built (above), so there are no inputs for the graphs",
              file=sys.stderr)
        return 1
    feeds = {batch: adapter_for_inputs.graph_inputs(pictures[:batch]) for batch in args.batches}
    for precision, path, bindings in graphs:
        for binding in bindings:
            label = f"onnxruntime CUDA, {precision}" + (", IO binding" if binding else "")
            gc.collect()  # the last row's session gone before this one's memory is counted
            before = process_gpu_gb()
            session = guarded(label, cuda_session, path)
            if isinstance(session, dict):
                rows[label] = session
                continue
            for batch in args.batches:
                run = bound_runner(session, feeds[batch]) if binding else (lambda f=feeds[batch]: session.run(None, f))
                timed_row(rows, label, batch, run, args.rounds, out, before)
            del session, run
        results["placement_" + precision] = guarded(f"{precision} placement", placement, path, feeds[1], out)
        print(f"{precision} graph on the CUDA provider, batch 1: {results['placement_' + precision]}", flush=True)
    results["cuda_graph"] = guarded("CUDA graphs", lambda: time_calls(
        bound_runner(cuda_session(graph, cuda_graph=True), feeds[1]), args.rounds, 1))
    print(f"onnxruntime CUDA, float32, CUDA graphs, batch 1: {results['cuda_graph']}", flush=True)

    if args.fused:
        fused_rows(args, out, feeds, results)

    # parity: the CUDA provider against the graph on the CPU provider (what `d2export export` verified)
    cpu = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [o.name for o in cpu.get_outputs()]
    reference = cpu.run(None, feeds[1])
    results["parity_cuda_vs_cpu"] = guarded("parity", lambda: parity(names, reference,
                                                                      cuda_session(graph).run(None, feeds[1])))
    print(f"parity, CUDA provider vs CPU provider, float32, batch 1: {results['parity_cuda_vs_cpu']}", flush=True)

    print_table(results, args.batches)
    print_goals(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


def fused_rows(args, out: Path, feeds: dict, results: dict) -> None:
    """The serving route, per batch: the fixed-size fused graph and its float16 copy, run as the Predictor does and
    replaying CUDA graphs; their predicted and measured host copies; the float32 graph's parity with the CPU."""
    import onnx
    import onnxruntime as ort

    from benchmarks.e2e import export_in_child
    from d2export.exporting.fp16 import to_float16
    from d2export.exporting.host_copies import census
    from d2export.exporting.sessions import session_options
    from d2export.runtime.bound_runs import BoundRuns

    rows = results["rows"]
    for batch in args.batches:
        graph = out / f"fused_b{batch}.onnx"
        sizes = ",".join([f"[{args.size},{args.size}]"] * batch)
        info = guarded(f"fused export, batch {batch}", export_in_child, args.config, "fused", "torchscript", graph,
                       "export.dynamic=false", f"export.dummy_sizes=[{sizes}]")
        if "error" in info:
            continue
        print(f"exported {graph} in {info['export_s']:.0f} s ({info['nodes']} nodes)", flush=True)
        half = out / f"fused_b{batch}_fp16.onnx"
        onnx.save(to_float16(onnx.load(str(graph))), str(half))
        for precision, path in (("float32", graph), ("float16", half)):
            results[f"census_fused_{precision}_b{batch}"] = guarded("census", census, path)
            results[f"placement_fused_{precision}_b{batch}"] = guarded(
                f"fused {precision} placement", placement, path, feeds[batch], out)
            print(f"fused {precision} b{batch}: predicted {results[f'census_fused_{precision}_b{batch}']}; "
                  f"on the GPU {results[f'placement_fused_{precision}_b{batch}']}", flush=True)
            for graphs in (False, True):
                label = f"onnxruntime CUDA, fused fixed-size, {precision}" + (", CUDA graph" if graphs else "")
                gc.collect()
                before = process_gpu_gb()
                session = guarded(label, cuda_session, path, cuda_graph=graphs)
                if isinstance(session, dict):
                    rows.setdefault(label, {})[batch] = session
                    continue
                feed = feeds[batch]
                if graphs:
                    runner = BoundRuns(session, [o.name for o in session.get_outputs()], "cuda")
                    run = lambda r=runner, f=feed: r.run(f)  # noqa: E731
                else:
                    run = lambda s=session, f=feed: s.run(None, f)  # noqa: E731
                timed_row(rows, label, batch, run, args.rounds, out, before)
                del session, run
        if batch == min(args.batches):  # parity, slot by slot, with the CPU provider (the verified side)
            cpu = ort.InferenceSession(str(graph), session_options(graph), providers=["CPUExecutionProvider"])
            names = [o.name for o in cpu.get_outputs()]
            reference = cpu.run(None, feeds[batch])
            results["parity_fused_cuda_vs_cpu"] = guarded("fused parity", lambda: parity(
                names, reference, cuda_session(graph).run(None, feeds[batch])))
            print(f"parity, fused float32 b{batch}, CUDA vs CPU provider: {results['parity_fused_cuda_vs_cpu']}",
                  flush=True)


def print_goals(results: dict) -> None:
    """The serving goals as ratios (eager time / onnxruntime time: above 1 the export is faster), where both rows
    ran: the best fused float32 and float16 rows against eager on the compiled kernel in float32 and under autocast."""
    rows = results["rows"]

    def ms(label, batch):
        row = rows.get(label, {}).get(batch, {})
        return row.get("per_picture_ms") if isinstance(row, dict) else None

    eager = "eager, compiled MSDA kernel"
    lines = []
    for batch in (1, 8):
        for precision, base in (("float32", eager), ("float16", eager), ("float16", eager + ", autocast float16")):
            ours = [ms(f"onnxruntime CUDA, fused fixed-size, {precision}{g}", batch) for g in ("", ", CUDA graph")]
            ours = [v for v in ours if v]
            theirs = ms(base, batch)
            if ours and theirs:
                lines.append(f"  batch {batch}: {base} / fused {precision} (best of with and without CUDA graphs) = "
                             f"{theirs / min(ours):.2f}x")
    print("\n## goals (x: eager ms per picture / onnxruntime's)\n" + ("\n".join(lines) or "  (rows missing)"))


def print_table(results: dict, batches) -> None:
    print(f"\n## {results['device']}, {results['size']}² (medians; ms per call and per picture; the GPU's kernels' "
          "ms in one traced call and the copies to the device; peak GPU GB)")
    print(f"{'runner':44s} " + " ".join(f"{f'b{b} call':>9s} {f'b{b} pic':>8s} {'kernels':>7s} {'HtoD':>5s} {'GB':>5s}"
                                        for b in batches))
    for label, by_batch in results["rows"].items():
        cells = []
        for b in batches:
            row = by_batch.get(b, {}) if "error" not in by_batch else {}
            gb = row.get("peak_gb", row.get("process_gpu_gb", float("nan")))
            cells.append(f"{row.get('wall_ms', float('nan')):9.1f} {row.get('per_picture_ms', float('nan')):8.1f} "
                         f"{row.get('kernel_ms', float('nan')):7.1f} {row.get('copies_to_device', -1):5d} {gb:5.2f}")
        print(f"{label:44s} " + " ".join(cells))


if __name__ == "__main__":
    main()
