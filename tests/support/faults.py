"""Injecting a fault into a running sync."""

from __future__ import annotations

import threading
import time

import pytest
import ray

import refit

__all__ = ["kill_during_syncs"]


def kill_during_syncs(syncer: refit.Syncer, victim, *, after_s: float, error: type[BaseException], match: str,
                      within_s: float = 60) -> BaseException:
    """Kill actor `victim` `after_s` into back-to-back syncs; the error one of them raises, within `within_s`.

    The syncs run until one fails (50 at most), so the kill lands mid-sync whatever a sync costs.
    """
    threading.Timer(after_s, lambda: ray.kill(victim)).start()
    start = time.monotonic()
    with pytest.raises(error, match=match) as raised:
        for _ in range(50):
            syncer.sync()
    assert time.monotonic() - start < within_s
    return raised.value
