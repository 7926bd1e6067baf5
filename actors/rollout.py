"""A rollout actor: one running vLLM engine that refit updates in place.

Two concurrency groups keep serving and updating apart: "update" runs the
update lifecycle strictly in submission order (one thread), "serve" runs
generation. A gate between them pauses generation while an update runs:
`begin_update` waits for in-flight requests to finish, then holds new ones
until `finish_update` has finalized the reload and the KV-scale stage, so no
request ever sees a half-updated model.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import ray

from refit.engine.rollout_engine import EngineConfig, EngineDescription, Generation, RolloutEngine
from refit.provenance import KvScalePolicy, ScaleRecord, format_table, to_json
from refit.orchestration.plan import TransferPlan
from refit.orchestration.stream import checkpoint_tensors
from refit.transport.buckets import WireBucket

__all__ = ["RolloutActor"]


class _ServingGate:
    """Readers (requests) or one writer (an update), never both."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests = 0
        self._updating = False

    @contextmanager
    def request(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._requests += 1
        try:
            yield
        finally:
            with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._updating = True
            self._cond.wait_for(lambda: self._requests == 0)

    def open(self) -> None:
        with self._cond:
            self._updating = False
            self._cond.notify_all()


@ray.remote(concurrency_groups={"update": 1, "serve": 1})
class RolloutActor:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = RolloutEngine(config)
        self._gate = _ServingGate()
        self._plan: TransferPlan | None = None
        self._version: int | None = None

    @ray.method(concurrency_group="serve")
    def describe(self) -> EngineDescription:
        with self._gate.request():  # talks to the workers: never during an update
            return self.engine.describe()

    # -- update lifecycle ("update" group: one thread, submission order) -------
    @ray.method(concurrency_group="update")
    def begin_update(self, plan: TransferPlan, version: int) -> None:
        """Pause serving (after in-flight requests finish), start the reload."""
        self._gate.close()
        try:
            self.engine.begin_update()
        except BaseException:
            self._gate.open()
            raise
        self._plan, self._version = plan, version

    @ray.method(concurrency_group="update")
    def load_bucket(self, bucket: WireBucket) -> float:
        """Load one bucket; returns seconds spent (fetching happened before the call)."""
        start = time.perf_counter()
        self.engine.load(checkpoint_tensors(self._plan, bucket), self._version)
        return time.perf_counter() - start

    @ray.method(concurrency_group="update")
    def finish_update(
        self, kv_scales: KvScalePolicy = KvScalePolicy.AUTO, calibration_prompts: Sequence[Sequence[int]] = ()
    ) -> tuple[float, list[str]]:
        """Finalize, run the post-refit stage, resume serving; returns (seconds, scales written)."""
        start = time.perf_counter()
        try:
            written = self.engine.finish_update(kv_scales, calibration_prompts)
        finally:
            self._gate.open()  # if the stage refused, the engine itself refuses to generate
        return time.perf_counter() - start, written

    @ray.method(concurrency_group="update")
    def abort_update(self) -> None:
        """After a failed sync: close the update, refuse to serve until the next one succeeds."""
        self.engine.abandon_update()
        self._gate.open()

    # -- serving ("serve" group) -------------------------------------------------
    @ray.method(concurrency_group="serve")
    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, prompt_logprobs: bool = False
    ) -> Generation:
        with self._gate.request():
            return self.engine.generate(prompts, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)

    # -- observation -------------------------------------------------------------
    @ray.method(concurrency_group="serve")
    def served_version(self) -> int | None:
        with self._gate.request():
            return self.engine.served_version()

    @ray.method(concurrency_group="serve")
    def scale_records(self) -> list[ScaleRecord]:
        with self._gate.request():
            return self.engine.scale_records()

    @ray.method(concurrency_group="serve")
    def scale_table(self, as_json: bool = False) -> str:
        records = self.scale_records()
        return to_json(records) if as_json else format_table(records)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def max_rss_bytes(self) -> int:
        """Peak resident memory of this process (Linux reports KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def rss_bytes(self) -> int:
        """Current resident memory of this process."""
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
