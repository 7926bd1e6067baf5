"""A rollout actor: one running vLLM engine that refit updates in place.

Three concurrency groups keep the roles apart: "update" runs the update
lifecycle in submission order (one thread), "serve" runs generation, and
"observe" answers status questions without waiting for either. Which step
may run when is decided by one `UpdateLifecycle` (refit/engine/lifecycle.py):
an update waits for in-flight requests, holds new ones until it is finished
or closed, and leaves the replica serving a whole version or refusing.

A watchdog thread closes an update whose sync stopped calling (the driver
died or was interrupted), so no replica is ever left paused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import ray

from actors._logging import show_refit_logs
from refit.engine.config import EngineConfig
from refit.engine.lifecycle import FinishedUpdate, ReplicaStatus, UpdateLifecycle
from refit.engine.rollout_engine import Generation, RolloutEngine
from refit.errors import ConfigError, SyncTimeoutError, VerificationError
from refit.orchestration.calls import remote_error
from refit.plan.config import Pause, SyncConfig, Verify
from refit.plan.data_path import loadable_tensors
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import KvScalePolicy, ScaleRecord, format_table, to_json
from refit.tokens import token_prompts
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import Rendezvous
from refit.verification import ProbeRequest, refuse_partial

__all__ = ["RolloutActor"]

_WATCHDOG_PERIOD_S = 0.5


@ray.remote(concurrency_groups={"update": 1, "serve": 1, "observe": 1})
class RolloutActor:
    def __init__(self, config: EngineConfig) -> None:
        show_refit_logs()
        self.engine = RolloutEngine(config)
        self._lifecycle = UpdateLifecycle(refusal=config.initial_refusal)
        self._update_lock = threading.Lock()  # update steps vs the watchdog
        self._open: tuple[TransferPlan, SyncConfig] | None = None  # of the update the lifecycle holds open
        self._progress = {"buckets": 0, "load_seconds": 0.0}  # of the open update
        self._last_update: dict | None = None  # what `refit inspect` shows
        self._group_id: str | None = None  # the collective group the workers joined
        threading.Thread(target=self._watch_leases, name="refit-lease-watchdog", daemon=True).start()

    # -- observation ("observe": never waits for an update or a request) -----
    @ray.method(concurrency_group="observe")
    def describe(self) -> RolloutModelInfo:
        return self.engine.model_info

    @ray.method(concurrency_group="observe")
    def status(self) -> ReplicaStatus:
        return self._lifecycle.status()

    @ray.method(concurrency_group="observe")
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="observe")
    def transport_ranks(self) -> int:
        """How many ranks this replica takes in a collective group: one per vLLM worker."""
        return self.engine.workers

    @ray.method(concurrency_group="observe")
    def transport_group(self) -> str | None:
        """The collective group this replica's workers are in, if any."""
        return self._group_id

    @ray.method(concurrency_group="observe")
    def last_update(self) -> dict | None:
        """The last update's outcome as plain data: sync id, version, buckets, seconds, scales written."""
        return self._last_update

    # -- update lifecycle ("update": one thread, submission order) ------------
    @ray.method(concurrency_group="update")
    def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        """Every worker joins a sync's collective group as members from `member_offset` on (leaving any earlier group).

        During an update only the sync that owns it (`sync_id`) may move the workers to another group.
        """
        with self._update_lock:
            self._lifecycle.check_group_change(sync_id)
            self._group_id = None
            self.engine.join_group(rendezvous, member_offset)
            self._group_id = rendezvous.group_id

    @ray.method(concurrency_group="update")
    def leave_transport(self) -> None:
        with self._update_lock:
            self._group_id = None
            self.engine.leave_group()

    @ray.method(concurrency_group="update")
    def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        """Pause serving (after in-flight requests finish), start the reload; returns the lowest version accepted."""
        if config.kv_scales is KvScalePolicy.RECOMPUTE:  # bad ids would fail only after every weight is loaded
            token_prompts(config.calibration_prompts, vocab_size=self.engine.vocab_size, setting="calibration_prompts")
        if config.pause is not Pause.WAIT:
            raise ConfigError(
                f"pause={str(config.pause)!r}: RolloutActor serves whole batches and always waits for them; "
                "actors.AsyncRolloutActor can abort requests in flight"
            )
        self.engine.check_transport(config.transport)  # before requests are held
        with self._update_lock:
            version = self._lifecycle.begin(sync_id, lease_s=config.timeout_s, drain_timeout_s=config.timeout_s)
            try:
                self.engine.begin_update(plan, config.transport)
            except BaseException as error:
                self._close(sync_id, f"starting the reload failed: {error!r}")
                raise
            self._open = (plan, config)
            self._progress = {"buckets": 0, "load_seconds": 0.0}
            return version

    @ray.method(concurrency_group="update")
    def load_bucket(
        self, sync_id: str, version: int, bucket: WireBucket | list[WireBucket | ray.ObjectRef | BucketContents],
        next_bucket_bytes: list[int | None] | None = None,
    ) -> float:
        """Load one bucket (one part per sending rank of a sharded trainer); returns seconds spent loading.

        Through Ray's object store the parts come as refs, fetched here; over
        `collective` or `ipc` as their contents, while the workers receive
        the bytes (`next_bucket_bytes`: each rank's next part's size, for the
        workers to post its receive early).
        """
        with self._update_lock:
            self._lifecycle.renew(sync_id, "load_bucket")
            plan, config = self._open
            verify = config.verify is not Verify.OFF
            if next_bucket_bytes is not None:
                self._lifecycle.loading(sync_id, version)
                start = time.perf_counter()
                self.engine.receive(bucket, next_bucket_bytes, version, verify=verify)
            else:
                tensors = loadable_tensors(plan, _fetch(bucket, config.timeout_s), verify=verify)
                self._lifecycle.loading(sync_id, version)
                start = time.perf_counter()
                self.engine.load(tensors, version, verify=verify)
            seconds = time.perf_counter() - start
            self._progress["buckets"] += 1
            self._progress["load_seconds"] += seconds
            return seconds

    @ray.method(concurrency_group="update")
    def finish_update(
        self, sync_id: str, version: int, probe: ProbeRequest | None = None
    ) -> FinishedUpdate:
        """Verify, finalize, run the post-refit stage (and the probe), serve `version`.

        A failed check raises; the sync then aborts the update and this replica refuses.
        """
        with self._update_lock:
            self._lifecycle.renew(sync_id, "finish_update")
            start = time.perf_counter()
            plan, config = self._open
            outcome, probe_passed = "off", None
            if config.verify is not Verify.OFF:
                received = self.engine.streamed()
                refuse_partial(plan, received)
            self.engine.finish_update()  # refuses an incomplete update, or scales the engine holds wrongly
            if config.verify is not Verify.OFF:
                outcome = f"checksums, {len(received)} tensors complete, scales read back"
            stage = "the post-refit KV-scale stage"
            try:
                written = self.engine.apply_kv_scales(config.kv_scales, config.calibration_prompts, version)
                if probe is not None:
                    stage = "the logprob probe"
                    result = self.engine.probe(probe)
                    outcome, probe_passed = f"{outcome}; {result}", result.passed
                    if not result.passed and probe.fail:
                        raise VerificationError(f"the logprob probe after the refit failed: {result}")
            except BaseException as error:
                self._close(sync_id, f"{stage} failed: {error}", model_changed=True)
                raise
            self._open = None
            self._lifecycle.finished(sync_id, version)
            seconds = time.perf_counter() - start
            self._record(sync_id, version, "served", finish_seconds=seconds, kv_scales_written=written, verification=outcome)
            return FinishedUpdate(seconds, tuple(written), outcome, probe_passed)

    @ray.method(concurrency_group="update")
    def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        """Close `sync_id`'s update if it is open; returns the status that leaves."""
        with self._update_lock:
            return self._close(sync_id, reason)

    def _close(self, sync_id: str, reason: str, *, model_changed: bool | None = None) -> ReplicaStatus:
        if self._lifecycle.open_update() != sync_id:
            return self._lifecycle.status()
        self._open = None
        try:
            self.engine.abandon_update()
        except BaseException as error:  # layers may be left in loadable form: never serve them
            reason, model_changed = f"{reason}; closing the reload failed too: {error!r}", True
        status = self._lifecycle.failed(sync_id, reason, model_changed=model_changed)
        self._record(sync_id, None, f"failed: {reason}")
        return status

    def _record(self, sync_id: str, version: int | None, outcome: str, **extra) -> None:
        self._last_update = {
            "sync_id": sync_id, "version": version, "outcome": outcome, "at": time.time(), **self._progress, **extra,
        }

    def _watch_leases(self) -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if self._lifecycle.expired() is None:
                continue
            with self._update_lock:
                expired = self._lifecycle.expired()  # a call may have renewed it meanwhile
                if expired is not None:
                    self._close(expired, f"sync {expired} stopped calling (its driver died or was interrupted)")

    # -- serving ("serve") -------------------------------------------------------
    @ray.method(concurrency_group="serve")
    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, *, prompt_logprobs: bool = False,
        temperature: float = 0.0, n: int = 1, seed: int | None = None,
    ) -> Generation:
        """`n` continuations per token-id prompt; waits out an update, refuses while refusing."""
        with self._lifecycle.request():
            return self.engine.generate(
                prompts, max_tokens, prompt_logprobs=prompt_logprobs, temperature=temperature, n=n, seed=seed
            )

    @ray.method(concurrency_group="serve")
    def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing: that is when it matters most)."""
        with self._lifecycle.request(allow_refusing=True):
            return self.engine.scale_records()

    @ray.method(concurrency_group="serve")
    def scale_table(self, as_json: bool = False) -> str:
        records = self.scale_records()
        return to_json(records) if as_json else format_table(records)


def _fetch(bucket: WireBucket | list[WireBucket | ray.ObjectRef], timeout_s: float) -> list[WireBucket]:
    """The bucket's parts; through Ray they come as `[ref, ...]`, and a trainer failure is stored in its object."""
    if isinstance(bucket, WireBucket):
        return [bucket]
    deadline = time.monotonic() + timeout_s
    parts = []
    for rank, part in enumerate(bucket):
        who = "the trainer" if len(bucket) == 1 else f"trainer rank {rank}"
        parts.append(part if isinstance(part, WireBucket) else _fetch_part(part, who, deadline - time.monotonic(), timeout_s))
    return parts


def _fetch_part(ref: ray.ObjectRef, who: str, remaining_s: float, timeout_s: float) -> WireBucket:
    try:
        return ray.get(ref, timeout=max(remaining_s, 0.0))
    except ray.exceptions.GetTimeoutError:
        raise SyncTimeoutError(f"fetching a bucket from the trainer took over {timeout_s:.0f} s (SyncConfig.timeout_s)") from None
    except Exception as error:  # the trainer raised (a refused tensor, ...) or is gone
        raise remote_error(error, who, "stream_buckets") from None
