"""Serving benchmark: the HTTP server on loopback, N requests from C client threads; p50/p95 latency and throughput.

Modes, side by side from one run:
- direct: the predictor in-process (decoded picture in, no HTTP) — the floor the server is measured against;
- http: POST /predict with PNG bytes (decode, resize, run, JSON);
- http+batch: the same with --max-batch C (concurrent requests share a session run).

With --process, `d2export serve` runs as its own process instead (its defaults: bounded in-flight runs, batching
where the graph allows; `--serve-args` adds options), once per entry of --process-modes, and its memory is reported:
RSS before the timed requests, after, and the peak (VmHWM).

    python benchmarks/serve.py [--model model.onnx | --config textdet_tiny] [--requests 200] [--clients 2]
    python benchmarks/serve.py --model model.onnx --process --clients 50 --requests 500
"""
from __future__ import annotations

import contextlib
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]

from d2export.argparsing import parser


def exported(config: str, out: Path) -> Path:
    from d2export import pipeline
    from d2export.config import load

    manifest = pipeline.export(load(config, [f"export.output_dir={out}", "verify.enabled=false"]))
    return out / manifest.model_file


class Rejected(Exception):
    """The server answered 503 (its queue is full or a request waited past its timeout): counted, not timed."""


def timed(call: Callable[[], None], requests: int, clients: int) -> dict:
    def one(_: int) -> float | None:
        t = time.perf_counter()
        try:
            call()
        except Rejected:
            return None
        return time.perf_counter() - t

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answered = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    latencies = sorted(t for t in answered if t is not None)
    if len(latencies) < 2:
        raise SystemExit(f"only {len(latencies)} of {requests} requests answered: the rest were rejected (503)")
    q = statistics.quantiles(latencies, n=20, method="inclusive")
    return {"p50": statistics.median(latencies) * 1e3, "p95": q[18] * 1e3, "mean": statistics.fmean(latencies) * 1e3,
            "rps": len(latencies) / wall, "rejected": requests - len(latencies)}


def memory_mb(pid: int) -> dict:
    """Current and peak resident memory of a process, from /proc (Linux)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024}


@contextlib.contextmanager
def serve_process(model: Path, args: list[str]) -> Iterator[tuple[str, int]]:
    """`d2export serve MODEL ARGS` on a free loopback port until the block ends; yields (base URL, pid)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "d2export.cli", "serve", str(model), "--port", str(port), *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"d2export serve did not start (exit {proc.poll()})")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = parser("benchmark.py serve", __doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an exported .onnx; default: export --config into a temp dir")
    ap.add_argument("--config", default="textdet_tiny", help="config to export when no --model is given")
    ap.add_argument("--requests", type=int, default=200, help="requests per mode")
    ap.add_argument("--clients", type=int, default=2, help="concurrent clients")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: one per core)")
    ap.add_argument("--size", default="480x640", help="the pictures' original HxW")
    ap.add_argument("--min-size", type=int, default=None, help="shortest edge (default: the manifest's)")
    ap.add_argument("--max-size", type=int, default=None, help="longest edge cap (default: the manifest's)")
    ap.add_argument("--modes", default="direct,http,http+batch", help="comma-separated: direct, http, http+batch")
    ap.add_argument("--batch-timeout-ms", type=float, default=5.0, help="http+batch: how long a request waits")
    ap.add_argument("--warmup", type=int, default=3, help="untimed requests first")
    ap.add_argument("--process", action="store_true", help="run `d2export serve` as its own process; report memory")
    ap.add_argument("--process-modes", default="batch:,no-batch:--max-batch 1",
                    help="--process: name:serve options, comma-separated")
    ap.add_argument("--serve-args", default="", help="--process: options added to every `d2export serve`")
    args = ap.parse_args(argv)

    import httpx
    from PIL import Image

    from d2export.resizing import synthetic_image
    from d2export.runtime.predictor import Predictor
    from d2export.runtime.server import create_app, serving

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else exported(args.config, Path(tmp))
        predictor = Predictor(model, threads=args.threads, min_size=args.min_size, max_size=args.max_size)
        h, w = map(int, args.size.split("x"))
        image = synthetic_image(h, w, seed=0).transpose(1, 2, 0).copy()
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "PNG")
        png = buf.getvalue()
        resized = predictor.prepare(image).chw.shape[1:]
        print(f"model {model.name} ({model.stat().st_size / 1e6:.0f} MB), picture {h}x{w} ({len(png) / 1e3:.0f} kB "
              f"PNG) → input {resized[0]}x{resized[1]}; {args.requests} requests from {args.clients} client threads, "
              f"onnxruntime threads {args.threads or 'default'}, {predictor.providers[0]}")

        rows = {}
        if args.process:
            import threading

            def post() -> None:  # one connection per client thread, as separate clients would have
                if not hasattr(local, "client"):
                    local.client = httpx.Client(base_url=url, timeout=600)
                r = local.client.post("/predict", content=png, headers={"content-type": "image/png"})
                if r.status_code == 503:
                    raise Rejected
                r.raise_for_status()

            sizes = [f"--min-size {args.min_size}"] * bool(args.min_size) + [f"--max-size {args.max_size}"] * bool(
                args.max_size) + [f"--threads {args.threads}"] * bool(args.threads)
            for entry in args.process_modes.split(","):
                mode, _, options = entry.partition(":")
                serve_args = " ".join([options, args.serve_args, *sizes]).split()
                with serve_process(model, serve_args) as (url, pid):
                    local = threading.local()
                    for _ in range(args.warmup):
                        post()
                    before = memory_mb(pid)
                    rows[mode] = timed(post, args.requests, args.clients)
                    after = memory_mb(pid)
                rows[mode]["batches"] = (f"RSS {before['rss']:.0f} → {after['rss']:.0f} MB, peak {before['peak']:.0f}"
                                         f" → {after['peak']:.0f} MB ({after['peak'] / before['peak']:.2f}x)")
                print(f"{mode}: {rows[mode]}", flush=True)
        for mode in args.modes.split(",") if not args.process else []:
            if mode == "direct":
                call = lambda: predictor.predict(image)  # noqa: E731
                for _ in range(args.warmup):
                    call()
                rows[mode] = timed(call, args.requests, args.clients)
                continue
            app = create_app(predictor, max_batch=args.clients if mode == "http+batch" else 1,
                             batch_timeout_ms=args.batch_timeout_ms)
            with serving(app) as url, httpx.Client(base_url=url, timeout=600) as client:
                def call() -> None:
                    r = client.post("/predict", content=png, headers={"content-type": "image/png"})
                    if r.status_code == 503:
                        raise Rejected
                    r.raise_for_status()

                for _ in range(args.warmup):
                    call()
                if app.state.batcher:
                    app.state.batcher.batch_sizes.clear()
                rows[mode] = timed(call, args.requests, args.clients)
                if app.state.batcher:
                    sizes = app.state.batcher.batch_sizes
                    rows[mode]["batches"] = " ".join(f"{k}x{n}" for k, n in sorted(sizes.items()))

    base = rows.get("direct")
    print(f"{'mode':<12} {'p50 ms':>9} {'p95 ms':>9} {'mean ms':>9} {'req/s':>8} {'503s':>5} {'p50 vs direct':>14}  "
          f"{'memory' if args.process else 'batches'}")
    for mode, r in rows.items():
        ratio = f"{r['p50'] / base['p50']:.2f}x" if base else "-"
        print(f"{mode:<12} {r['p50']:>9.1f} {r['p95']:>9.1f} {r['mean']:>9.1f} {r['rps']:>8.2f} {r['rejected']:>5} "
              f"{ratio:>14}  {r.get('batches', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
