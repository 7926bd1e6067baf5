"""What the trainer actors measure about their own streams: time spent producing, and private memory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["private_rss_bytes", "timed"]

T = TypeVar("T")


def timed(items: Iterator[T], add_seconds: Callable[[float], None]) -> Iterator[T]:
    """Yield `items`, reporting the time spent producing each one (not the time the consumer holds it)."""
    while True:
        start = time.perf_counter()
        item = next(items, None)
        add_seconds(time.perf_counter() - start)
        if item is None:
            return
        yield item
        del item  # not held while the next item is made (a bucket buffer each)


def private_rss_bytes() -> int:
    """This process's resident memory minus shared pages.

    Shared pages are left out: buckets put in or fetched from Ray's object
    store are mapped from its shared arena, and each new bucket touches new
    pages of it until the whole arena is resident, which would read as a leak.
    """
    with open("/proc/self/statm") as f:
        _, resident, shared, *_ = (int(x) for x in f.read().split())
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")
