"""An asynchronous rollout actor: vLLM's AsyncLLM serving many concurrent requests, updated in place by refit.

A thin shell over `AsyncReplica` (refit/engine/async_llm.py), which runs
the same `ReplicaCore` as `RolloutActor` with an adapter for `AsyncLLM`;
the replica methods `refit.Syncer` calls come from `AsyncReplicaMethods`,
the mixin a user's own async actor takes too. Each `generate` call is one
request; Ray runs them concurrently and vLLM batches them continuously. How
an update holds, drains or aborts requests (`SyncConfig.pause`) is
described in refit/engine/async_llm.py.

Why requests run in a concurrency group of their own: an update holds new
requests, each awaiting in the actor, and Ray admits at most
`max_concurrency` calls at once per group. Sharing the default group, the
held requests would fill it and the sync's next call would wait behind
them until its deadline. Apart, the sync's calls keep the default group
(its `max_concurrency`) and requests have `SERVE_CONCURRENCY`.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from actors._logging import show_refit_logs
from refit.engine.async_llm import AsyncReplicaMethods, Completion, async_llm_replica, start_async_llm
from refit.engine.config import EngineConfig
from refit.provenance import format_table, to_json

__all__ = ["SERVE_CONCURRENCY", "AsyncRolloutActor"]

SERVE_CONCURRENCY = 1000
"""Requests one actor runs or holds at once (Ray's default `max_concurrency` for an async actor); more wait in Ray."""


@ray.remote(concurrency_groups={"serve": SERVE_CONCURRENCY})
class AsyncRolloutActor(AsyncReplicaMethods):
    def __init__(self, config: EngineConfig) -> None:
        show_refit_logs()
        self.replica = async_llm_replica(start_async_llm(config))

    @ray.method(concurrency_group="serve")
    async def generate(
        self, prompt: Sequence[int], max_tokens: int = 8, *, temperature: float = 0.0, seed: int | None = None
    ) -> Completion:
        """One request: its tokens, logprobs, the version that produced them, and whether an update aborted it."""
        return await self.replica.serve(prompt, max_tokens, temperature=temperature, seed=seed)

    async def scale_table(self, as_json: bool = False) -> str:
        records = await self.scale_records()
        return to_json(records) if as_json else format_table(records, digest=(self.replica.last_update() or {}).get("digest"))
