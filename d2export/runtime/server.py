"""The HTTP server: `POST /predict` (image bytes, or a multipart form with an image file), `GET /healthz`,
`GET /metadata`.

The model is loaded once at start. A bad picture (not an image, truncated, empty, zero-size, too many bytes or
pixels) gets a 4xx with a message and the server goes on serving. With `max_batch > 1`, requests that arrive within
`batch_timeout_ms` of each other share one session run (mixed sizes are padded; the graph masks the padding): worth
it on a GPU, rarely on a CPU, where one picture already keeps the cores busy.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import socket
import sys
import threading
import time
from typing import Iterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from d2export.runtime.images import MAX_PIXELS, BadImage, ImageTooLarge, decode_image
from d2export.runtime.predictor import (Prediction, Predictor, Prepared, ProviderUnavailable,
                                        add_predictor_arguments, predictor_from_args)

MAX_BYTES = 32 << 20


class Batcher:
    """Gathers concurrent requests into batches of at most `max_batch`, waiting at most `timeout_s` for company."""

    def __init__(self, predictor: Predictor, max_batch: int, timeout_s: float):
        self.predictor, self.max_batch, self.timeout_s = predictor, max_batch, timeout_s
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
            self.batch_sizes[len(items)] += 1
            try:
                results = await run_in_threadpool(self.predictor.predict_prepared, [it[0] for it in items],
                                                  [it[1] for it in items])
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error, the loop goes on
                for it in items:
                    if not it[2].done():
                        it[2].set_exception(e)
                continue
            for it, result in zip(items, results):
                if not it[2].done():
                    it[2].set_result(result)


async def _read_image_bytes(request: Request, max_bytes: int) -> bytes:
    """The picture's bytes from a raw body or the first file of a multipart form, refusing more than max_bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ImageTooLarge(f"request body is {int(declared)} bytes; the limit is {max_bytes}")
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        files = [v for v in form.values() if hasattr(v, "read")]
        if not files:
            raise HTTPException(400, "multipart form holds no file: send the image as a file field, e.g. 'file'")
        data = await files[0].read()
    else:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ImageTooLarge(f"request body exceeds {max_bytes} bytes")
            chunks.append(chunk)
        data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {max_bytes}")
    return data


def create_app(predictor: Predictor, max_batch: int = 1, batch_timeout_ms: float = 5.0,
               max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS) -> FastAPI:
    batcher = Batcher(predictor, max_batch, batch_timeout_ms / 1000) if max_batch > 1 else None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if batcher:
            batcher.start()
        yield
        if batcher:
            await batcher.stop()

    app = FastAPI(title="d2export", lifespan=lifespan)
    app.state.batcher = batcher
    metadata = predictor.metadata() | {"max_batch": max_batch, "max_bytes": max_bytes, "max_pixels": max_pixels}

    @app.exception_handler(BadImage)
    async def bad_image(request: Request, e: BadImage):
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metadata")
    async def get_metadata():
        return metadata

    @app.post("/predict")
    async def predict(request: Request, score_threshold: float | None = None):
        """Body: the image file's bytes (any Content-Type but multipart), or multipart/form-data with a file."""
        started = time.perf_counter()
        data = await _read_image_bytes(request, max_bytes)

        def prepare() -> Prepared:
            return predictor.prepare(decode_image(data, max_pixels), "RGB")

        prepared = await run_in_threadpool(prepare)
        try:
            if batcher:
                result = await batcher.submit(prepared, score_threshold)
            else:
                result = await run_in_threadpool(predictor.predict_prepared, [prepared], [score_threshold])
                result = result[0]
        except Exception as e:  # noqa: BLE001 - a failed run answers 500 and the server keeps serving
            raise HTTPException(500, f"inference failed: {type(e).__name__}: {e}") from None
        return result.to_dict() | {"seconds": round(time.perf_counter() - started, 4)}

    return app


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0) -> Iterator[str]:
    """Runs `app` under uvicorn in a background thread for the `with` block; yields its base URL (port 0: a free
    one). Stops the server on leaving. For tests and benchmarks."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
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
    ap = argparse.ArgumentParser(prog="d2export serve", description="Serve an exported model over HTTP.")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=8000)
    add_predictor_arguments(ap)
    ap.add_argument("--max-batch", type=int, default=1, help="batch concurrent requests up to this many")
    ap.add_argument("--batch-timeout-ms", type=float, default=5.0, help="how long a request waits for company")
    ap.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="largest request body accepted")
    ap.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="largest picture accepted (width × height)")
    args = ap.parse_args(argv)
    import uvicorn

    try:
        predictor = predictor_from_args(args)
    except (OSError, ValueError, ProviderUnavailable) as e:
        print(f"d2export serve: error: {e}", file=sys.stderr)
        return 2
    app = create_app(predictor, args.max_batch, args.batch_timeout_ms, args.max_bytes, args.max_pixels)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
