"""What the trainer actors measure about their own streams: private memory (the time is `TrainerWeights`'s)."""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["private_rss_bytes"]

T = TypeVar("T")


def private_rss_bytes() -> int:
    """This process's resident memory minus shared pages.

    Shared pages are left out: buckets put in or fetched from Ray's object
    store are mapped from its shared arena, and each new bucket touches new
    pages of it until the whole arena is resident, which would read as a leak.
    """
    with open("/proc/self/statm") as f:
        _, resident, shared, *_ = (int(x) for x in f.read().split())
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")
