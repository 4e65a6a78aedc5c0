"""Progress: the export's steps in the log; on long steps, bars (tqdm, on stderr, only when stderr is a terminal: logs
and tests stay clean)."""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def step(i: int, what: str, detail: str = "") -> None:
    """Step `i` of the export's six (pipeline.py's flow; verification logs its own step 5)."""
    logging.getLogger("d2export").info("[%d/6] %s%s", i, what, f": {detail}" if detail else "")


def steps(items: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
    """`items`, with a bar counting them."""
    from tqdm import tqdm

    yield from tqdm(items, desc=what, total=total, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """A bar with the elapsed time for one long call (an export, the parity ladder) that reports no progress."""
    from tqdm import tqdm

    bar = tqdm(desc=what, total=None, file=sys.stderr, disable=None, leave=False, bar_format="{desc}: {elapsed}")
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
