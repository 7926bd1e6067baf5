"""An asynchronous rollout actor: vLLM's AsyncLLM serving many concurrent requests, updated in place by refit.

Each `generate` call is one request; Ray runs them concurrently on the
actor's event loop and vLLM batches them continuously. An update
(`begin_update` ... `finish_update`, in submission order under one lock):

1. closes the actor's gate: new requests wait in `generate`, outside vLLM;
2. `pause="wait"`: waits until every admitted request has finished. vLLM's
   own "wait" pause is not enough on its own: it lets *running* requests
   finish but keeps queued ones, which then run on the new weights.
   `pause="abort"`: waits until every admitted request has reached the
   engine core, so vLLM's pause, sent next, covers all of them;
3. pauses vLLM (`SyncConfig.pause`): with nothing left to wait for, or
   ending every request (running or queued), returned marked aborted;
4. loads the buckets over the `collective` or `ipc` transport;
5. resumes vLLM's scheduler, runs the post-refit stage (which may
   generate: recomputed KV scales, the probe) while requests are still
   held at the gate, then opens it.

So every output carries the version that produced all of its tokens: the
version served when it was admitted. The update state (versions, leases,
refusals) is the same `UpdateLifecycle` as `RolloutActor`'s; a watchdog task
closes an update whose sync stopped calling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import ray

from actors._logging import show_refit_logs
from refit.engine.async_engine import AsyncRolloutEngine, Completion
from refit.engine.config import EngineConfig
from refit.engine.lifecycle import FinishedUpdate, Phase, ReplicaStatus, UpdateLifecycle
from refit.errors import ConfigError, ReplicaRefusingError, SyncTimeoutError, VerificationError
from refit.plan.config import Pause, SyncConfig, Verify
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import KvScalePolicy, ScaleRecord, format_table, to_json
from refit.tokens import token_prompts
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.verification import ProbeRequest, refuse_partial

__all__ = ["AsyncRolloutActor"]

_WATCHDOG_PERIOD_S = 0.5


@ray.remote
class AsyncRolloutActor:
    def __init__(self, config: EngineConfig) -> None:
        show_refit_logs()
        self.engine = AsyncRolloutEngine(config)
        self._lifecycle = UpdateLifecycle(refusal=config.initial_refusal)
        self._update_lock = asyncio.Lock()  # update steps, in submission order, and the watchdog
        self._gate = asyncio.Event()  # set: requests may enter the engine
        self._gate.set()
        self._admitting = 0  # requests past the gate whose add has not yet reached the engine core
        self._in_flight = 0  # requests past the gate that have not finished
        self._admitted = asyncio.Condition()
        self._open: tuple[TransferPlan, SyncConfig] | None = None
        self._group_id: str | None = None
        self._last_update: dict | None = None
        self._watchdog: asyncio.Task | None = None

    # -- observation ---------------------------------------------------------------
    def describe(self) -> RolloutModelInfo:
        return self.engine.model_info

    def status(self) -> ReplicaStatus:
        return self._lifecycle.status()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def transport_ranks(self) -> int:
        return self.engine.workers

    def transport_group(self) -> str | None:
        return self._group_id

    def last_update(self) -> dict | None:
        return self._last_update

    async def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing)."""
        return await self.engine.scale_records()

    async def scale_table(self, as_json: bool = False) -> str:
        records = await self.scale_records()
        return to_json(records) if as_json else format_table(records)

    # -- serving ----------------------------------------------------------------------
    async def generate(
        self, prompt: Sequence[int], max_tokens: int = 8, *, temperature: float = 0.0, seed: int | None = None
    ) -> Completion:
        """One request: its tokens, logprobs, the version that produced them, and whether an update aborted it."""
        while True:
            await self._gate.wait()  # an update holds new requests here
            status = self._lifecycle.status()
            if status.phase is Phase.REFUSING:
                raise ReplicaRefusingError(f"this replica refuses to serve: {status.reason}")
            if status.phase is Phase.SERVING and self._gate.is_set():
                break
        self._admitting += 1  # no await since the gate check: an update cannot slip in between
        self._in_flight += 1
        try:
            try:
                queue = await self.engine.admit(prompt, max_tokens, temperature=temperature, seed=seed)
            finally:
                self._admitting -= 1
                await self._notify()
            return await self.engine.collect(queue, status.served_version)
        finally:
            self._in_flight -= 1
            await self._notify()

    async def _notify(self) -> None:
        async with self._admitted:
            self._admitted.notify_all()

    # -- transport ---------------------------------------------------------------------
    async def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        async with self._update_lock:
            self._lifecycle.check_group_change(sync_id)
            self._group_id = None
            await self.engine.join_group(rendezvous, member_offset)
            self._group_id = rendezvous.group_id

    async def leave_transport(self) -> None:
        async with self._update_lock:
            self._group_id = None
            await self.engine.leave_group()

    # -- update lifecycle ---------------------------------------------------------------
    async def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        """Hold new requests, pause vLLM (wait for or abort those in flight), start the reload."""
        self.engine.check_transport(config.transport)
        if config.kv_scales is KvScalePolicy.RECOMPUTE:
            token_prompts(config.calibration_prompts, vocab_size=self.engine.vocab_size, setting="calibration_prompts")
        self._start_watchdog()
        async with self._update_lock:
            self._gate.clear()
            try:
                version = self._lifecycle.begin(sync_id, lease_s=config.timeout_s, drain_timeout_s=config.timeout_s)
            except BaseException:
                self._gate.set()
                raise
            try:
                await asyncio.wait_for(self._drain(config), timeout=config.timeout_s)
                await self.engine.begin_update(plan, config.transport)
            except BaseException as error:
                if isinstance(error, TimeoutError):
                    error = SyncTimeoutError(f"requests in flight did not finish within {config.timeout_s:.0f} s (pause='wait')")
                await self._close(sync_id, f"starting the update failed: {error!r}")
                raise error from None
            self._open = (plan, config)
            self._progress = {"buckets": 0, "load_seconds": 0.0}
            return version

    async def _drain(self, config: SyncConfig) -> None:
        """Step 2 and 3 of the module docstring."""
        async with self._admitted:
            if config.pause is Pause.WAIT:
                await self._admitted.wait_for(lambda: self._in_flight == 0)
            else:
                await self._admitted.wait_for(lambda: self._admitting == 0)
        await self.engine.pause(config.pause)

    async def load_bucket(
        self, sync_id: str, version: int, bucket: list[BucketContents], next_bucket_bytes: list[int | None] | None = None
    ) -> float:
        """Load one bucket (a part per sending rank) whose bytes the workers receive over the transport."""
        async with self._update_lock:
            self._lifecycle.renew(sync_id, "load_bucket")
            _, config = self._open
            if next_bucket_bytes is None:
                raise ConfigError("AsyncRolloutActor receives bytes over transport='collective' or 'ipc' only")
            self._lifecycle.loading(sync_id, version)
            start = time.perf_counter()
            await self.engine.receive(bucket, next_bucket_bytes, version, verify=config.verify is not Verify.OFF)
            seconds = time.perf_counter() - start
            self._progress["buckets"] += 1
            self._progress["load_seconds"] += seconds
            return seconds

    async def finish_update(
        self, sync_id: str, version: int, probe: ProbeRequest | None = None
    ) -> FinishedUpdate:
        """Verify, finalize, resume vLLM, run the post-refit stage (and the probe) with requests still held, serve."""
        async with self._update_lock:
            self._lifecycle.renew(sync_id, "finish_update")
            start = time.perf_counter()
            plan, config = self._open
            outcome, probe_passed, stage = "off", None, "finishing the reload"
            try:
                if config.verify is not Verify.OFF:
                    received = await self.engine.streamed()
                    refuse_partial(plan, received)
                await self.engine.finish_update()
                if config.verify is not Verify.OFF:
                    outcome = f"checksums, {len(received)} tensors complete, scales read back"
                await self.engine.resume()  # the stage may generate; users' requests wait at the gate
                stage = "the post-refit KV-scale stage"
                written = await self.engine.apply_kv_scales(config.kv_scales, config.calibration_prompts, version)
                if probe is not None:
                    stage = "the logprob probe"
                    result = await self.engine.probe(probe)
                    outcome, probe_passed = f"{outcome}; {result}", result.passed
                    if not result.passed and probe.fail:
                        raise VerificationError(f"the logprob probe after the refit failed: {result}")
            except BaseException as error:
                await self._close(sync_id, f"{stage} failed: {error}", model_changed=stage != "finishing the reload" or None)
                raise
            self._open = None
            self._lifecycle.finished(sync_id, version)
            self._gate.set()
            seconds = time.perf_counter() - start
            self._record(sync_id, version, "served", finish_seconds=seconds, kv_scales_written=written, verification=outcome)
            return FinishedUpdate(seconds, tuple(written), outcome, probe_passed)

    async def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        async with self._update_lock:
            return await self._close(sync_id, reason)

    async def _close(self, sync_id: str, reason: str, *, model_changed: bool | None = None) -> ReplicaStatus:
        if self._lifecycle.open_update() != sync_id:
            return self._lifecycle.status()
        self._open = None
        try:
            await self.engine.abandon_update()
        except BaseException as error:  # layers may be left in loadable form: never serve them
            reason, model_changed = f"{reason}; closing the reload failed too: {error!r}", True
        try:
            await self.engine.resume()
        except BaseException as error:
            reason, model_changed = f"{reason}; resuming vLLM's scheduler failed: {error!r}", True
        status = self._lifecycle.failed(sync_id, reason, model_changed=model_changed)
        self._gate.set()  # waiting requests now run, or are refused
        self._record(sync_id, None, f"failed: {reason}")
        return status

    def _record(self, sync_id: str, version: int | None, outcome: str, **extra) -> None:
        self._last_update = {
            "sync_id": sync_id, "version": version, "outcome": outcome, "at": time.time(),
            **getattr(self, "_progress", {}), **extra,
        }

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_leases())

    async def _watch_leases(self) -> None:
        while True:
            await asyncio.sleep(_WATCHDOG_PERIOD_S)
            if self._lifecycle.expired() is None:
                continue
            async with self._update_lock:
                expired = self._lifecycle.expired()
                if expired is not None:
                    await self._close(expired, f"sync {expired} stopped calling (its driver died or was interrupted)")
