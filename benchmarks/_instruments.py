"""What `bench_alternatives` measures inside the trainer and the rollout, run there with `__ray_call__`.

- `MemorySampler`: a thread sampling the process's private resident memory
  (`actors._measure.private_rss_bytes`: buckets in Ray's object store are
  shared pages and left out) every millisecond, for the peak over a sync
  above what the process held before it.
- `StageClock`: seconds per stage of one sync, by wrapping the functions
  each stage calls in the actor's process. Only for a separate, untimed
  sync: the wrappers add a little time of their own, so the medians come
  from syncs without them.
- The floor of a sync, each side alone: `capture_loads_start`/`_stop` keep
  a private copy of every bucket's tensors a sync hands the rollout's
  engine, and `load_alone` hands them to it again (the same worker calls,
  no transfer); `produce_alone` runs the trainer's bucket production with
  no consumer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["StageClock", "capture_loads_start", "capture_loads_stop", "drop_loads", "load_alone", "memory_start", "memory_stop",
           "produce_alone", "shared_file_bytes", "stages_start", "stages_stop"]


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


def shared_file_bytes(actor: Any) -> int:
    """The size of the trainer process's ring of shm files (`refit.transport.shm`): written pages are shared memory,
    which private RSS leaves out."""
    from refit.transport.shm import shared_segments

    return shared_segments().nbytes()


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
        import refit.transport.kinds.shm as shm_transport
        from refit.transport.delta import ReplicaBase

        clock.wrap(ray_transport, "fetch_parts", "fetch")
        clock.wrap(shm_transport, "open_shm_bucket", "map")
        clock.wrap(data_path, "_check_tags", "verify")
        clock.wrap(ReplicaBase, "rebuild", "keep base / rebuild delta")
        clock.wrap(actor.replica.workers, "load", "load")
        clock.wrap(actor.replica.workers, "receive", "receive (shm: map, verify, load)")
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


# -- the floor: each side's share of a sync, alone ----------------------------------------------------

def capture_loads_start(actor: Any) -> None:
    """In the rollout: keep a private copy of each bucket's tensors the next sync hands the engine (`workers.load`:
    after the fetch, the tag check and the delta base), with the version and `verify` it passed."""
    workers = actor.replica.workers
    original = workers.load
    captured: list[tuple[list[tuple[str, Any]], int, bool]] = []

    def load(tensors: Sequence[tuple[str, Any]], version: int, *, verify: bool) -> None:
        captured.append(([(name, tensor.clone()) for name, tensor in tensors], version, verify))
        original(tensors, version, verify=verify)

    workers.load = load
    actor._bench_loads = captured
    actor._bench_loads_undo = lambda: setattr(workers, "load", original)


def capture_loads_stop(actor: Any) -> tuple[int, int]:
    """Stop capturing; (buckets, bytes) kept for `load_alone`."""
    actor.__dict__.pop("_bench_loads_undo")()
    loads = actor._bench_loads
    return len(loads), sum(t.numel() * t.element_size() for tensors, _, _ in loads for _, t in tensors)


def load_alone(actor: Any, plan: Any, transport: str = "ray") -> float:
    """In the rollout: the captured sync's load again, from the copies in this process: the engine calls the sync
    makes (start the layerwise reload, every bucket's tensors to `load_weights`, finish: finalize, scale read-back),
    and nothing else: no fetch, no tag check, no delta base, no pause, no KV-scale stage. Seconds."""
    replica = actor.replica
    with replica._lock:  # no update of the replica's own can start meanwhile
        start = time.perf_counter()
        replica.workers.start_update(plan, transport)
        try:
            for tensors, version, verify in actor._bench_loads:
                replica.workers.load(tensors, version, verify=verify)
            replica.workers.finish_update()
        except BaseException:
            replica.workers.abandon_update()
            raise
        return time.perf_counter() - start


def drop_loads(actor: Any) -> None:
    actor.__dict__.pop("_bench_loads", None)


def produce_alone(actor: Any, plan: Any, transport: str = "ray", max_buckets_in_flight: int = 2) -> float:
    """In the trainer: every bucket of `plan` as its weights produce them for a sync over `transport` (preflight,
    quantize into the bucket's buffer, which is the transport's own memory where it lends some, pack, integrity tags
    if the plan has a key), each dropped as soon as made: no consumer, no sending, no delta base. Seconds."""
    from refit.transport.buckets import buffers_from
    from refit.transport.kinds import transport_kind

    kind = transport_kind(transport)
    allocate = None if kind.traits.one_group else kind.bucket_buffers(kind.stream_handle(max_buckets_in_flight, None))
    start = time.perf_counter()
    buckets = actor.weights._produce(plan)
    while True:
        with buffers_from(allocate):
            if next(buckets, None) is None:
                break
    return time.perf_counter() - start
