"""An asynchronous rollout actor: vLLM's AsyncLLM serving many concurrent requests, updated in place by refit.

A thin shell over `AsyncReplica` (refit/engine/async_llm.py), which runs
the same `ReplicaCore` as `RolloutActor` with an adapter for `AsyncLLM`;
the replica methods `refit.Syncer` calls come from `AsyncReplicaMethods`,
the mixin a user's own async actor takes too. Each `generate` call is one
request; Ray runs them concurrently on the actor's event loop and vLLM
batches them continuously. How an update holds, drains or aborts requests
(`SyncConfig.pause`) is described in refit/engine/async_llm.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from actors._logging import show_refit_logs
from refit.engine.async_llm import AsyncReplicaMethods, Completion, async_llm_replica, start_async_llm
from refit.engine.config import EngineConfig
from refit.provenance import format_table, to_json

__all__ = ["AsyncRolloutActor"]


@ray.remote
class AsyncRolloutActor(AsyncReplicaMethods):
    def __init__(self, config: EngineConfig) -> None:
        show_refit_logs()
        self.replica = async_llm_replica(start_async_llm(config))

    async def generate(
        self, prompt: Sequence[int], max_tokens: int = 8, *, temperature: float = 0.0, seed: int | None = None
    ) -> Completion:
        """One request: its tokens, logprobs, the version that produced them, and whether an update aborted it."""
        return await self.replica.serve(prompt, max_tokens, temperature=temperature, seed=seed)

    async def scale_table(self, as_json: bool = False) -> str:
        records = await self.scale_records()
        return to_json(records) if as_json else format_table(records, digest=(self.replica.last_update() or {}).get("digest"))
