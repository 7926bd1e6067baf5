"""What `bench_alternatives` measures inside the trainer and the rollout, run there with `__ray_call__`.

- `MemorySampler`: a thread sampling the process's private resident memory
  (`actors._measure.private_rss_bytes`: buckets in Ray's object store are
  shared pages and left out) every millisecond, for the peak over a sync
  above what the process held before it.
- `StageClock`: seconds per stage of one sync, by wrapping the functions
  each stage calls in the actor's process. Only for a separate, untimed
  sync: the wrappers add a little time of their own, so the medians come
  from syncs without them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["StageClock", "memory_start", "memory_stop", "stages_start", "stages_stop"]


class MemorySampler:
    def __init__(self, period_s: float = 0.001) -> None:
        from actors._measure import private_rss_bytes

        self._read = private_rss_bytes
        self.baseline = self.peak = private_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.peak = max(self.peak, self._read())

    def stop(self) -> int:
        """Peak private bytes above the baseline."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())
        return self.peak - self.baseline


def memory_start(actor: Any) -> None:
    actor._bench_memory = MemorySampler()


def memory_stop(actor: Any) -> int:
    return actor.__dict__.pop("_bench_memory").stop()


class StageClock:
    """Seconds spent in wrapped functions, by stage name; `undo()` puts the originals back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attribute: str, stage: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, original))

    def undo(self) -> dict[str, float]:
        for undo in reversed(self._undo):
            undo()
        return self.seconds


def stages_start(actor: Any) -> None:
    """Wrap the stage functions of whichever side `actor` is (a trainer has `model`, a rollout `replica`)."""
    clock = actor._bench_stages = StageClock()
    if hasattr(actor, "replica"):
        import refit.plan.data_path as data_path
        import refit.transport.kinds.ray as ray_transport
        from refit.transport.delta import ReplicaBase

        clock.wrap(ray_transport, "fetch_parts", "fetch")
        clock.wrap(data_path, "_check_tags", "verify")
        clock.wrap(ReplicaBase, "rebuild", "keep base / rebuild delta")
        clock.wrap(actor.replica.workers, "load", "load")
        clock.wrap(actor.replica.workers, "finish_update", "finalize")
        clock.wrap(actor.replica, "_apply_kv_scales", "post-refit stage")
    else:
        import refit.plan.data_path as data_path
        import refit.transport.buckets as buckets

        clock.wrap(data_path, "_preflight", "preflight")
        clock.wrap(data_path, "quantize_fp8_block", "quantize")
        clock.wrap(buckets, "tag", "integrity tag")
        from refit.transport.delta import SenderBase

        clock.wrap(SenderBase, "_delta", "delta encode")


def stages_stop(actor: Any) -> dict[str, float]:
    return actor.__dict__.pop("_bench_stages").undo()
