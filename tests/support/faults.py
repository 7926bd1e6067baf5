"""Injecting a fault into a running sync."""

from __future__ import annotations

import threading
import time

import pytest
import ray

import refit

__all__ = ["die_at", "die_when_joining", "kill_during_syncs", "kill_mid_stream"]


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


def kill_mid_stream(victim, *, after_buckets: int = 3, within_s: float = 300) -> threading.Thread:
    """Kill rollout actor `victim` once an update of it has loaded `after_buckets` buckets; the (started) watching thread.

    Watching the replica's own progress, not a clock, puts the kill mid-stream however loaded the machine
    is. The thread gives up after `within_s`; join it, then check `victim` is dead.
    """
    from tests.support.actors import buckets_loaded, run_in

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if run_in(victim, buckets_loaded) >= after_buckets:
                ray.kill(victim)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, name="kill-mid-stream", daemon=True)
    thread.start()
    return thread


def die_at(rank, method: str, call: int) -> None:
    """Run in a `TrainerRank` (`run_in`): its process exits at its `call`-th call of its source's `method`, a crash at a chosen point."""
    import os

    original, calls = getattr(rank.source, method), [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            os._exit(1)
        return original(*args, **kwargs)

    setattr(rank.source, method, dying)


def die_when_joining(trainer) -> None:
    """Run in a `TrainerActor` (`run_in`): its process exits when a sync asks it to join a collective group."""
    import os

    def dying(*args, **kwargs):
        os._exit(1)

    trainer._transport.join = dying
