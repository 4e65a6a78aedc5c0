"""The HTTP server: `POST /predict` (image bytes, or a multipart form with an image file), `GET /healthz`,
`GET /metadata`, `GET /metrics` (Prometheus text).

The model is loaded once at start. A bad picture (not an image, truncated, empty, zero-size, too many bytes or
pixels, an aspect ratio too extreme to resize, float pixels out of range) gets a 4xx with a message and the server
goes on serving.

Work is bounded, so memory does not grow with the number of clients (onnxruntime keeps the memory the most
concurrent runs ever reached): at most `in_flight` requests decode and run at once (default: the cores divided by
each run's threads, capped by the memory available for the model's runs), at most `max_queue` wait for a turn, each
for at most `queue_timeout_s`; beyond that the answer is 503 with Retry-After. With `max_batch > 1` (the default
where the graph's batch axis is dynamic), requests that arrive within `batch_timeout_ms` of each other share one
session run, one batch at a time. Bodies are counted while they stream, whatever their form, and must arrive within
`read_timeout_s`; a connection that does not finish its request headers in that time is closed.

Memory, measured with the tiny model (tests/test_serving_faults.py): the server's peak RSS under 50 concurrent
clients stays within 2x of its peak after one client's requests without batching, and within 2.5x with batching by 4
(a batch holds four pictures' activations at once); before this bound, it grew tenfold.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from d2export.argparsing import parser
from d2export.instances import Prediction
from d2export.runtime.image_decoding import MAX_PIXELS, BadImage, ImageTooLarge, decode_image
from d2export.runtime.maps import prediction_json
from d2export.runtime.predictor import Predictor
from d2export.runtime.processing import Prepared, equal_size_groups
from d2export.runtime.providers import ProviderUnavailable
from d2export.runtime.serving_arguments import add_predictor_arguments, predictor_from_args

MAX_BYTES = 32 << 20
MAX_QUEUE = 64
QUEUE_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 30.0
DEFAULT_BATCH = 4
RUN_MEMORY_SHARE = 0.5  # of the memory available at start, what the model's concurrent runs may take


class Busy(Exception):
    """No room for the request now: answered 503 with Retry-After."""

    def __init__(self, detail: str, reason: str, retry_after: int):
        super().__init__(detail)
        self.reason, self.retry_after = reason, retry_after


class SlowClient(BadImage):
    status = 408


def default_in_flight(threads: int, model_bytes: int) -> int:
    """Concurrent model runs: enough to keep the cores busy (a run with `threads` = 0 already uses them all), no
    more than the memory available affords at an estimated max(256 MB, 8 × the model file) per run."""
    cores = os.cpu_count() or 1
    by_cores = max(1, cores // threads) if threads > 0 else 1
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return by_cores
    per_run = max(256 << 20, 8 * model_bytes)
    return max(1, min(by_cores, int(available * RUN_MEMORY_SHARE // per_run)))


def default_max_batch(predictor: Predictor) -> int:
    """Batching on where the graph's batch axis is dynamic (a name, not a number)."""
    return DEFAULT_BATCH if predictor.max_batch is None else 1


class Admission:
    """At most `running` requests hold a turn; at most `max_waiting` wait for one, each at most `timeout_s`."""

    def __init__(self, running: int, max_waiting: int, timeout_s: float):
        self.running_limit, self.max_waiting, self.timeout_s = running, max_waiting, timeout_s
        self.turns = asyncio.Semaphore(running)
        self.waiting = self.running = 0
        self.seconds_per_turn = 1.0  # running mean, for Retry-After

    def retry_after(self) -> int:
        return max(1, math.ceil(self.seconds_per_turn * (self.waiting + 1) / self.running_limit))

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        if self.turns.locked() and self.waiting >= self.max_waiting:
            raise Busy(f"server busy: {self.running} running and {self.waiting} waiting (the most allowed)",
                       "queue_full", self.retry_after())
        self.waiting += 1
        try:
            await asyncio.wait_for(self.turns.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise Busy(f"server busy: no turn within {self.timeout_s:g} s", "timeout",
                       self.retry_after()) from None
        finally:
            self.waiting -= 1
        self.running += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self.running -= 1
            self.turns.release()
            self.seconds_per_turn += 0.2 * (time.perf_counter() - started - self.seconds_per_turn)


class Metrics:
    """Prometheus metrics of one app (its own registry: several apps may live in one process)."""

    def __init__(self, admission: Admission):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("d2export_requests", "POST /predict requests by status", ["status"],
                                registry=self.registry)
        self.latency = Histogram("d2export_request_seconds", "POST /predict latency, body read to answer",
                                 registry=self.registry,
                                 buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, float("inf")))
        self.rejected = Counter("d2export_rejected", "requests refused for lack of room (503)", ["reason"],
                                registry=self.registry)
        Gauge("d2export_queue_depth", "requests waiting for a turn", registry=self.registry
              ).set_function(lambda: admission.waiting)
        Gauge("d2export_in_flight", "requests decoding or running", registry=self.registry
              ).set_function(lambda: admission.running)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Batcher:
    """Gathers concurrent requests into batches of at most `max_batch`, waiting at most `timeout_s` for company;
    one batch runs at a time, on `pool`, as one session run per picture size (no picture is padded for another's
    sake, so an answer never depends on which requests came with it)."""

    def __init__(self, predictor: Predictor, max_batch: int, timeout_s: float, pool: ThreadPoolExecutor):
        self.predictor, self.max_batch, self.timeout_s, self.pool = predictor, max_batch, timeout_s, pool
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.batch_sizes: collections.Counter = collections.Counter()  # size → how many batches ran with it

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def submit(self, prepared: Prepared, score_threshold: float | None) -> Prediction:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((prepared, score_threshold, future))
        return await future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            deadline = loop.time() + self.timeout_s
            while len(items) < self.max_batch and (left := deadline - loop.time()) > 0:
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            items = [it for it in items if not it[2].cancelled()]  # clients that hung up
            if not items:
                continue
            prepared = [it[0] for it in items]
            for group in equal_size_groups(prepared):
                self.batch_sizes[len(group)] += 1
            try:
                results = await loop.run_in_executor(self.pool, self.predictor.predict_unpadded,
                                                     prepared, [it[1] for it in items])
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error, the loop goes on
                for it in items:
                    if not it[2].done():
                        it[2].set_exception(e)
                continue
            for it, result in zip(items, results):
                if not it[2].done():
                    it[2].set_result(result)


async def _body_chunks(request: Request, max_bytes: int, timeout_s: float) -> AsyncIterator[bytes]:
    """The request body as it streams, refused (413) past `max_bytes` and (408) when not in within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ImageTooLarge(f"request body is {int(declared)} bytes; the limit is {max_bytes}")
    loop = asyncio.get_running_loop()
    deadline, size = loop.time() + timeout_s, 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(deadline - loop.time(), 0.001))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise SlowClient(f"request body not received within {timeout_s:g} s ({size} bytes arrived)") from None
        size += len(chunk)
        if size > max_bytes:
            raise ImageTooLarge(f"request body exceeds {max_bytes} bytes")
        yield chunk


async def _read_image_bytes(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The picture's bytes from a raw body or the first file of a multipart form; the limits hold while it streams
    (a multipart form is parsed from the counted stream, never spooled whole first)."""
    chunks = _body_chunks(request, max_bytes, timeout_s)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return b"".join([c async for c in chunks])
    from starlette.formparsers import MultiPartException, MultiPartParser

    try:
        form = await MultiPartParser(request.headers, chunks, max_files=8, max_fields=64,
                                     max_part_size=max_bytes).parse()
    except MultiPartException as e:
        raise BadImage(f"malformed multipart form: {e.message}") from None
    try:
        files = [v for v in form.values() if hasattr(v, "read")]
        if not files:
            raise BadImage("multipart form holds no file: send the image as a file field, e.g. 'file'")
        return await files[0].read()
    finally:
        await form.close()


def create_app(predictor: Predictor, max_batch: int | None = None, batch_timeout_ms: float = 5.0,
               max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS, in_flight: int | None = None,
               max_queue: int = MAX_QUEUE, queue_timeout_s: float = QUEUE_TIMEOUT_S,
               read_timeout_s: float = READ_TIMEOUT_S) -> FastAPI:
    """`max_batch`/`in_flight` None: the defaults described in the module's docstring."""
    max_batch = default_max_batch(predictor) if max_batch is None else max_batch
    in_flight = in_flight or default_in_flight(predictor.threads, predictor.model_path.stat().st_size)
    pool = ThreadPoolExecutor(in_flight, thread_name_prefix="d2export-run")
    batcher = Batcher(predictor, max_batch, batch_timeout_ms / 1000, pool) if max_batch > 1 else None
    # with batching, one batch runs while the next gathers; each request's decoding counts as its own turn
    admission = Admission(max(in_flight, 2 * max_batch) if batcher else in_flight, max_queue, queue_timeout_s)
    metrics = Metrics(admission)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if batcher:
            batcher.start()
        yield
        if batcher:
            await batcher.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="d2export", lifespan=lifespan)
    app.state.batcher, app.state.admission, app.state.read_timeout_s = batcher, admission, read_timeout_s
    metadata = predictor.metadata() | {"max_batch": max_batch, "max_bytes": max_bytes, "max_pixels": max_pixels,
                                       "in_flight": in_flight, "max_queue": max_queue}

    @app.exception_handler(BadImage)
    async def bad_image(request: Request, e: BadImage):
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    @app.exception_handler(Busy)
    async def busy(request: Request, e: Busy):
        return JSONResponse({"detail": str(e)}, status_code=503, headers={"Retry-After": str(e.retry_after)})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metadata")
    async def get_metadata():
        return metadata

    @app.get("/metrics")
    async def get_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def prepare(data: bytes) -> Prepared:
        return predictor.prepare(decode_image(data, max_pixels), "RGB")

    async def answer(request: Request, score_threshold: float | None) -> dict:
        started = time.perf_counter()
        data = await _read_image_bytes(request, max_bytes, read_timeout_s)
        loop = asyncio.get_running_loop()
        async with admission.turn():
            prepared = await loop.run_in_executor(pool, prepare, data)
            del data
            try:
                if batcher:
                    result = await batcher.submit(prepared, score_threshold)
                else:
                    result = (await loop.run_in_executor(pool, predictor.predict_prepared, [prepared],
                                                         [score_threshold]))[0]
            except Exception as e:  # noqa: BLE001 - a failed run answers 500 and the server keeps serving
                raise HTTPException(500, f"inference failed: {type(e).__name__}: {e}") from None
        return prediction_json(result) | {"seconds": round(time.perf_counter() - started, 4)}

    @app.post("/predict")
    async def predict(request: Request,
                      score_threshold: float | None = Query(None, ge=0, le=1, allow_inf_nan=False)):
        """Body: the image file's bytes (any Content-Type but multipart), or multipart/form-data with a file."""
        started, status = time.perf_counter(), 500
        try:
            body = await answer(request, score_threshold)
            status = 200
            return body
        except Busy as e:
            status = 503
            metrics.rejected.labels(e.reason).inc()
            raise
        except (BadImage, HTTPException) as e:
            status = getattr(e, "status", None) or e.status_code
            raise
        finally:
            metrics.requests.labels(str(status)).inc()
            metrics.latency.observe(time.perf_counter() - started)

    return app


def uvicorn_config(app, read_timeout_s: float = READ_TIMEOUT_S, **kwargs):
    """uvicorn's settings with a deadline on request headers: uvicorn itself waits forever for the first request
    of a connection, and a client trickling header bytes keeps resetting its keep-alive timer."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        """Closes the connection when a request's headers have not all arrived `read_timeout_s` after the
        connection opened or the previous response went out."""

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(read_timeout_s, self._too_slow)

        def _too_slow(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._deadline.cancel()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._deadline.cancel()
            super().connection_lost(exc)

    return uvicorn.Config(app, http=HeaderDeadline, **kwargs)


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0) -> Iterator[str]:
    """Runs `app` under uvicorn in a background thread for the `with` block; yields its base URL (port 0: a free
    one). Stops the server on leaving. For tests and benchmarks."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, app.state.read_timeout_s, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="d2export-server")
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = parser("d2export serve", "Serve an exported model over HTTP: POST /predict, GET /healthz and /metadata.")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port")
    add_predictor_arguments(ap)
    ap.add_argument("--max-batch", type=int, default=None,
                    help=f"batch concurrent requests up to this many (default: {DEFAULT_BATCH} where the graph's batch "
                         "axis is dynamic, else 1; 1 turns batching off)")
    ap.add_argument("--batch-timeout-ms", type=float, default=5.0, help="how long a request waits for company")
    ap.add_argument("--in-flight", type=int, default=None,
                    help="requests decoding and running at once (default: from the cores and the model's memory)")
    ap.add_argument("--max-queue", type=int, default=MAX_QUEUE, help="requests waiting for a turn; more get 503")
    ap.add_argument("--queue-timeout", type=float, default=QUEUE_TIMEOUT_S,
                    help="seconds a request waits for a turn before 503")
    ap.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S,
                    help="seconds a client has to send its request headers, and again its body")
    ap.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="largest request body accepted")
    ap.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="largest picture accepted (width × height)")
    args = ap.parse_args(argv)
    import uvicorn

    try:
        predictor = predictor_from_args(args)
    except (OSError, ValueError, ProviderUnavailable) as e:
        print(f"d2export serve: error: {e}", file=sys.stderr)
        return 2
    print(f"d2export serve: {predictor.providers_line()}", file=sys.stderr)
    app = create_app(predictor, args.max_batch, args.batch_timeout_ms, args.max_bytes, args.max_pixels,
                     args.in_flight, args.max_queue, args.queue_timeout, args.read_timeout)
    uvicorn.Server(uvicorn_config(app, args.read_timeout, host=args.host, port=args.port, log_level="info")).run()
    return 0
