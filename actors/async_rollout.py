"""An asynchronous rollout actor: vLLM's AsyncLLM serving many concurrent requests, updated in place by refit.

A thin shell over `AsyncReplica` (refit/engine/async_llm.py), which runs
the same `ReplicaCore` as `RolloutActor` with an adapter for `AsyncLLM`.
Each `generate` call is one request; Ray runs them concurrently on the
actor's event loop and vLLM batches them continuously. How an update holds,
drains or aborts requests (`SyncConfig.pause`) is described in
refit/engine/async_llm.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from actors._logging import show_refit_logs
from refit.engine.async_llm import AsyncReplica, Completion, start_async_llm
from refit.engine.config import EngineConfig
from refit.engine.lifecycle import FinishedUpdate, ReplicaStatus
from refit.plan.config import SyncConfig
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import ScaleRecord, format_table, to_json
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.verification import ProbeRequest

__all__ = ["AsyncRolloutActor"]


@ray.remote
class AsyncRolloutActor:
    def __init__(self, config: EngineConfig) -> None:
        show_refit_logs()
        self.replica = AsyncReplica(start_async_llm(config))

    # -- observation ---------------------------------------------------------------
    def describe(self) -> RolloutModelInfo:
        return self.replica.describe()

    def status(self) -> ReplicaStatus:
        return self.replica.status()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def transport_ranks(self) -> int:
        return self.replica.transport_ranks()

    def transport_group(self) -> str | None:
        return self.replica.transport_group()

    def last_update(self) -> dict | None:
        return self.replica.last_update()

    async def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing)."""
        return await self.replica.scale_records()

    async def scale_table(self, as_json: bool = False) -> str:
        records = await self.scale_records()
        return to_json(records) if as_json else format_table(records)

    # -- serving ----------------------------------------------------------------------
    async def generate(
        self, prompt: Sequence[int], max_tokens: int = 8, *, temperature: float = 0.0, seed: int | None = None
    ) -> Completion:
        """One request: its tokens, logprobs, the version that produced them, and whether an update aborted it."""
        return await self.replica.serve(prompt, max_tokens, temperature=temperature, seed=seed)

    # -- update lifecycle ---------------------------------------------------------------
    async def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        await self.replica.join_transport(rendezvous, member_offset, sync_id)

    async def leave_transport(self) -> None:
        await self.replica.leave_transport()

    async def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        return await self.replica.begin_update(plan, sync_id, config)

    async def load_bucket(
        self, sync_id: str, version: int, bucket: list[BucketContents], next_bucket_bytes: list[int | None] | None = None
    ) -> float:
        return await self.replica.load_bucket(sync_id, version, bucket, next_bucket_bytes)

    async def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        return await self.replica.finish_update(sync_id, version, probe)

    async def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        return await self.replica.abort_update(sync_id, reason)
