"""Progress on long steps (tqdm, on stderr, only when stderr is a terminal: logs and tests stay clean)."""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


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
