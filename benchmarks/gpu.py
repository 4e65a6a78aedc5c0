"""GPU benchmark: the text spotter on one NVIDIA GPU, eager PyTorch against onnxruntime's CUDA provider.

    python tools/benchmark.py gpu [--config textdet] [--model GRAPH.onnx] [--size 640] [--batches 1 8]
        [--rounds 20] [--upstream-msda DIR] [--simplified] [--out DIR] [--json FILE] [--no-plugin]
        [--no-placement] [--settings-batches 8] [--export-only]

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

The CUDA provider's settings (issue 69): on the fixed-size fused graphs, at each of --settings-batches, every setting
of `SETTINGS` is a row of its own over the verified one (float16 with tensor cores, use_tf32=1; fused convolution
bias; MatMul+Add left unfused, so no broadcast-bias kernel before cuBLAS; NHWC convolutions), then at every batch
d2export's defaults for the graph's precision (what the Predictor serves with: `cuda_options`, MatMulAddFusion off),
with and without CUDA graphs; the --model graph gets a defaults row too. Each of these rows carries its per-slot
parity with the float32 graph on the CPU provider at its batch (`parity_vs_cpu`). A SIGTERM (a `timeout`) still writes
what was measured.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.e2e import parity
from d2export.argparsing import parser

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
        if not target.is_file() or target.read_text() != text:  # unchanged sources keep their time: no rebuild
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


# --- the CUDA provider's settings -----------------------------------------------------------------------------
VERIFIED = {"use_tf32": "0"}  # what verification compared: onnxruntime's defaults, TF32 off
DEFAULTS = "d2export defaults"
# each setting alone over VERIFIED: (CUDA provider options, graph transformers disabled, float16 graphs only)
SETTINGS = {
    "tensor cores (use_tf32=1)": ({"use_tf32": "1"}, (), True),  # float32 graphs stay exact
    "fused conv bias": ({"fuse_conv_bias": "1"}, (), False),
    "MatMul+Add unfused": ({}, ("MatMulAddFusion",), False),
    "NHWC": ({"prefer_nhwc": "1"}, (), False),
}


def setting(name: str | None, precision: str) -> tuple[dict, tuple]:
    """A row's CUDA provider options and disabled graph transformers: None is the verified session, DEFAULTS the
    Predictor's own for a graph of `precision`, else one of SETTINGS over the verified session."""
    from d2export.runtime.providers import CUDA_DISABLED_OPTIMIZERS, options_per_provider

    if name is None:
        return dict(VERIFIED), ()
    if name == DEFAULTS:
        return options_per_provider(["CUDAExecutionProvider"], precision=precision)[0], CUDA_DISABLED_OPTIMIZERS
    options, disabled, _ = SETTINGS[name]
    return VERIFIED | options, disabled


def fixed_rows(precision: str, settings: bool) -> list[tuple[str | None, bool]]:
    """The fixed-size fused graph's rows at one batch, as (setting, CUDA graph): verified and the defaults, each with
    and without CUDA graphs, and with `settings` each setting that applies to `precision` alone."""
    each = [(name, False) for name, (_, _, half_only) in SETTINGS.items() if precision == "float16" or not half_only]
    return [(None, False), (None, True)] + (each if settings else []) + [(DEFAULTS, False), (DEFAULTS, True)]


def row_label(base: str, name: str | None, graphs: bool = False) -> str:
    return base + (f", {name}" if name else "") + (", CUDA graph" if graphs else "")


def cuda_session(path: Path, profile_prefix: str | None = None, cuda_graph: bool = False,
                 options: dict | None = None, disabled: tuple = ()):
    """The graph on the CUDA provider with `options` (default: VERIFIED) and the graph transformers `disabled`."""
    import onnxruntime as ort

    from d2export.verification.check_sessions import session_options
    from d2export.runtime.providers import DISABLED_OPTIMIZERS_KEY

    opts = session_options(path)  # the fused operator's library registered where the graph has it
    opts.log_severity_level = 3
    if disabled:
        opts.add_session_config_entry(DISABLED_OPTIMIZERS_KEY, ";".join(disabled))
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    cuda = dict(VERIFIED if options is None else options) | ({"enable_cuda_graph": "1"} if cuda_graph else {})
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


def timed_row(rows: dict, label: str, batch: int, run, rounds: int, out: Path, before_gb: float,
              reference: tuple | None = None) -> None:
    """One onnxruntime row at one batch: wall times, the GPU memory the session added, one traced call; with
    `reference` (output names, the CPU provider's outputs for these pictures) the per-slot parity of what `run`
    returns."""
    row = guarded(f"{label} batch {batch}", time_calls, run, rounds, batch)
    row["process_gpu_gb"] = process_gpu_gb() - before_gb
    row.update(guarded(f"{label} GPU trace", traced_gpu_activity, run, out))
    if reference:
        row["parity_vs_cpu"] = guarded(f"{label} parity", lambda: parity(*reference, run()))
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
    p.add_argument("--no-plugin", dest="plugin", action="store_false",
                   help="skip eager PyTorch on the plugin's MSDA (the compiled kernel's rows stay: the goals' base)")
    p.add_argument("--no-placement", dest="placement", action="store_false",
                   help="skip the profiled runs that count nodes per provider and Memcpy nodes, and the census")
    p.add_argument("--settings-batches", type=int, nargs="+",
                   help="the batches at which each CUDA setting gets a row of its own (default: every batch; the "
                        "verified session and d2export's defaults run at every batch)")
    p.add_argument("--export-only", action="store_true",
                   help="export the fixed-size fused graphs and their float16 copies into --out, then stop (a later "
                        "run with the same --out uses them)")
    args = p.parse_args(argv)

    if args.export_only:
        if not args.out:
            p.error("--export-only needs --out (where the later run finds the graphs)")
        for batch in args.batches:
            made = guarded(f"fused export, batch {batch}", fixed_fused_graphs, args, Path(args.out), batch)
            print(f"batch {batch}: {made}", flush=True)
        return 0

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
    # a `timeout` ends the run with SIGTERM: what was measured is still printed and written (finally, below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return measure(args, out, results)
    finally:
        print_table(results, args.batches)
        print_goals(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))


def measure(args, out: Path, results: dict) -> int | None:
    """The rows in the order that matters when a `timeout` cuts the run short: eager (the goals' base), the fixed-size
    fused graphs with every CUDA setting, then the --model graph."""
    import torch

    from d2export.tracing import dummy_images

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
    if args.plugin or not models:  # the inputs come from an eager model: the plugin's where the kernel is missing
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
    if args.fused:
        fused_rows(args, out, feeds, results)
    model_rows(args, out, feeds, results)
    return None


def model_rows(args, out: Path, feeds: dict, results: dict) -> None:
    """The --model graph (default: the config's gather graph, exported here) and its float16 copy: as verified, fed
    from the host as the Predictor does and (float32) with IO binding, and with d2export's defaults; their placement;
    CUDA graphs tried; parity with the graph on the CPU provider at the smallest batch."""
    import onnx
    import onnxruntime as ort

    from d2export.exporting.fp16 import to_float16
    from d2export.verification.check_sessions import session_options

    graph = Path(args.model) if args.model else out / "gather.onnx"
    if not args.model:
        from benchmarks.e2e import export_in_child

        info = export_in_child(args.config, "gather", "torchscript", graph)
        print(f"exported {graph} in {info['export_s']:.0f} s ({info['nodes']} nodes)", flush=True)
    half = out / (graph.stem + "_fp16.onnx")
    onnx.save(to_float16(onnx.load(str(graph))), str(half))
    # IO binding (inputs and outputs left on the GPU) bought nothing in float16 either (docs/gpu.md): float32 only
    graphs = [("float32", graph, (False, True)), ("float16", half, (False,))]
    if args.simplified:  # export.simplify=true: onnxslim folds shape arithmetic that the CUDA provider runs on the CPU
        import onnxslim

        slim = out / (graph.stem + "_slim.onnx")
        onnx.save(onnxslim.slim(onnx.load(str(graph))), str(slim))
        graphs.append(("float32 onnxslim", slim, (False,)))

    rows = results["rows"]
    first = min(args.batches)  # what `d2export export` verified: the float32 graph on the CPU provider
    cpu = ort.InferenceSession(str(graph), session_options(graph), providers=["CPUExecutionProvider"])
    reference = ([o.name for o in cpu.get_outputs()], cpu.run(None, feeds[first]))
    del cpu
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
                timed_row(rows, label, batch, run, args.rounds, out, before,
                          reference if batch == first and not binding else None)
            del session, run
        graph_rows(rows, f"onnxruntime CUDA, {precision}", [(DEFAULTS, False)], precision, path, feeds, args, out,
                   {first: reference})
        if args.placement:
            results["placement_" + precision] = guarded(f"{precision} placement", placement, path, feeds[first], out)
            print(f"{precision} graph on the CUDA provider, batch {first}: {results['placement_' + precision]}",
                  flush=True)
    results["cuda_graph"] = guarded("CUDA graphs", lambda: time_calls(
        bound_runner(cuda_session(graph, cuda_graph=True), feeds[first]), args.rounds, first))
    print(f"onnxruntime CUDA, float32, CUDA graphs, batch {first}: {results['cuda_graph']}", flush=True)
    # the CUDA provider against the graph on the CPU provider (what `d2export export` verified)
    results["parity_cuda_vs_cpu"] = rows.get("onnxruntime CUDA, float32", {}).get(first, {}).get(
        "parity_vs_cpu", {"error": "row missing"})
    print(f"parity, CUDA provider vs CPU provider, float32, batch {first}: {results['parity_cuda_vs_cpu']}",
          flush=True)


def graph_rows(rows: dict, base: str, which, precision: str, path: Path, feeds: dict, args, out: Path,
               references: dict) -> None:
    """`which` ((setting, CUDA graph) pairs) on the graph at `path`, each its own session, run as the Predictor runs
    it at every batch in `feeds`; where `references` has the batch, the per-slot parity with the CPU provider."""
    from d2export.runtime.bound_runs import BoundRuns

    for name, graphs in which:
        label = row_label(base, name, graphs)
        options, disabled = setting(name, precision)
        gc.collect()
        before = process_gpu_gb()
        session = guarded(label, cuda_session, path, cuda_graph=graphs, options=options, disabled=disabled)
        if isinstance(session, dict):
            rows[label] = session
            print(f"{label}: {session}", flush=True)
            continue
        rows.setdefault(label, {})["options"] = {"cuda": options, "disabled_optimizers": list(disabled)}
        runner = BoundRuns(session, [o.name for o in session.get_outputs()], "cuda") if graphs else None
        for batch, feed in feeds.items():
            run = (lambda f=feed: list(runner.run(f).values())) if runner else (lambda f=feed: session.run(None, f))
            timed_row(rows, label, batch, run, args.rounds, out, before,
                      (references[batch][0], references[batch][1]) if batch in references else None)
        del session, runner


def fixed_fused_graphs(args, out: Path, batch: int) -> dict:
    """The fixed-size fused graph for `batch` (`export.sampler=fused export.dynamic=false`, `fused_b{batch}.onnx`)
    and its float16 copy in `out`, each made unless already there (`--export-only` makes them ahead)."""
    import onnx

    from benchmarks.e2e import export_in_child
    from d2export.exporting.fp16 import to_float16

    graph, half = out / f"fused_b{batch}.onnx", out / f"fused_b{batch}_fp16.onnx"
    made = {"float32": str(graph), "float16": str(half)}
    out.mkdir(parents=True, exist_ok=True)
    if not graph.is_file():
        partial = out / f".fused_b{batch}.partial.onnx"  # a graph is there whole or not at all
        sizes = ",".join([f"[{args.size},{args.size}]"] * batch)
        info = export_in_child(args.config, "fused", "torchscript", partial, "export.dynamic=false",
                               f"export.dummy_sizes=[{sizes}]")
        partial.replace(graph)
        made["export_s"], made["nodes"] = info["export_s"], info["nodes"]
    if not half.is_file():
        partial = out / f".fused_b{batch}_fp16.partial.onnx"
        onnx.save(to_float16(onnx.load(str(graph))), str(partial))
        partial.replace(half)
    return made


def fused_rows(args, out: Path, feeds: dict, results: dict) -> None:
    """The serving route, per batch: the fixed-size fused graph and its float16 copy, run as the Predictor does and
    replaying CUDA graphs, verified and with each CUDA setting (`fixed_rows`); their predicted and measured host
    copies; every row's parity with the float32 graph on the CPU provider at its batch."""
    import onnxruntime as ort

    from d2export.verification.host_copies import census
    from d2export.verification.check_sessions import session_options

    rows = results["rows"]
    settings_batches = set(args.settings_batches or args.batches)
    for batch in args.batches:
        made = guarded(f"fused export, batch {batch}", fixed_fused_graphs, args, out, batch)
        if "error" in made:
            continue
        print(f"fused graphs, batch {batch}: {made}", flush=True)
        graph = Path(made["float32"])
        cpu = ort.InferenceSession(str(graph), session_options(graph), providers=["CPUExecutionProvider"])
        reference = ([o.name for o in cpu.get_outputs()], cpu.run(None, feeds[batch]))
        del cpu
        for precision in ("float32", "float16"):
            path = Path(made[precision])
            if args.placement:
                results[f"census_fused_{precision}_b{batch}"] = guarded("census", census, path)
                results[f"placement_fused_{precision}_b{batch}"] = guarded(
                    f"fused {precision} placement", placement, path, feeds[batch], out)
                print(f"fused {precision} b{batch}: predicted {results[f'census_fused_{precision}_b{batch}']}; "
                      f"on the GPU {results[f'placement_fused_{precision}_b{batch}']}", flush=True)
            graph_rows(rows, f"onnxruntime CUDA, fused fixed-size, {precision}",
                       fixed_rows(precision, batch in settings_batches), precision, path, {batch: feeds[batch]},
                       args, out, {batch: reference})
        if batch == min(args.batches):  # the verified session's parity, as the earlier runs reported it
            verified = rows.get("onnxruntime CUDA, fused fixed-size, float32", {}).get(batch, {})
            results["parity_fused_cuda_vs_cpu"] = verified.get("parity_vs_cpu", {"error": "row missing"})
            print(f"parity, fused float32 b{batch}, CUDA vs CPU provider: {results['parity_fused_cuda_vs_cpu']}",
                  flush=True)


def print_goals(results: dict) -> None:
    """The serving goals as ratios (eager time / onnxruntime time: above 1 the export is faster), where both rows
    ran: the best fused float32 and float16 rows (verified or d2export's defaults, which keep float32 exact; with or
    without CUDA graphs) against eager on the compiled kernel in float32 and under autocast."""
    rows = results["rows"]

    def ms(label, batch):
        row = rows.get(label, {}).get(batch, {})
        return row.get("per_picture_ms") if isinstance(row, dict) else None

    eager = "eager, compiled MSDA kernel"
    lines = []
    for batch in (1, 8):
        for precision, base in (("float32", eager), ("float16", eager), ("float16", eager + ", autocast float16")):
            ours = [ms(row_label(f"onnxruntime CUDA, fused fixed-size, {precision}", name, graphs), batch)
                    for name in (None, DEFAULTS) for graphs in (False, True)]
            ours = [v for v in ours if v]
            theirs = ms(base, batch)
            if ours and theirs:
                lines.append(f"  batch {batch}: {base} / fused {precision} (best of verified and {DEFAULTS}, with "
                             f"and without CUDA graphs) = {theirs / min(ours):.2f}x")
    print("\n## goals (x: eager ms per picture / onnxruntime's)\n" + ("\n".join(lines) or "  (rows missing)"))


def print_table(results: dict, batches) -> None:
    print(f"\n## {results['device']}, {results['size']}² (medians; ms per call and per picture; the GPU's kernels' "
          "ms in one traced call and the copies to the device; peak GPU GB)")
    width = max([44] + [len(label) for label in results["rows"]])
    print(f"{'runner':{width}s} " + " ".join(
        f"{f'b{b} call':>9s} {f'b{b} pic':>8s} {'kernels':>7s} {'HtoD':>5s} {'GB':>5s}" for b in batches))
    checked = []
    for label, by_batch in results["rows"].items():
        cells = []
        for b in batches:
            row = by_batch.get(b, {}) if "error" not in by_batch else {}
            gb = row.get("peak_gb", row.get("process_gpu_gb", float("nan")))
            cells.append(f"{row.get('wall_ms', float('nan')):9.1f} {row.get('per_picture_ms', float('nan')):8.1f} "
                         f"{row.get('kernel_ms', float('nan')):7.1f} {row.get('copies_to_device', -1):5d} {gb:5.2f}")
            if isinstance(row.get("parity_vs_cpu"), dict):
                checked.append((label, b, row["parity_vs_cpu"]))
        print(f"{label:{width}s} " + " ".join(cells))
    if checked:
        print("\n## parity with the float32 graph on the CPU provider (largest differences; the share of ids equal)")
        for label, b, found in checked:
            print(f"{label:{width}s} b{b}: " + ", ".join(
                f"{k} {v:.3g}" if "error" not in found else str(found["error"])[:120] for k, v in found.items()))


if __name__ == "__main__":
    main()
