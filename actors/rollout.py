"""A rollout actor: one running vLLM engine that refit updates in place.

A thin shell over `ReplicaCore` (refit/engine/replica.py), the one
implementation of a replica's side of a sync, holding an in-process
`vllm.LLM` that `start_llm` started from an `EngineConfig`. The methods
`refit.Syncer` calls, and their concurrency groups, are `ReplicaShell`'s
(actors/_replica_shell.py); generation is this actor's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from actors._logging import show_refit_logs
from actors._replica_shell import CONCURRENCY_GROUPS, ReplicaShell
from refit.engine.config import EngineConfig
from refit.engine.llm import LLMAdapter, start_llm
from refit.engine.replica import Generation, ReplicaCore

__all__ = ["RolloutActor"]


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class RolloutActor(ReplicaShell):
    def __init__(self, config: EngineConfig) -> None:
        show_refit_logs()
        self.engine = LLMAdapter(start_llm(config))
        self.replica = ReplicaCore(self.engine)

    # -- serving ("serve") -------------------------------------------------------
    @ray.method(concurrency_group="serve")
    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, *, prompt_logprobs: bool = False,
        temperature: float = 0.0, n: int = 1, seed: int | None = None,
    ) -> Generation:
        """`n` continuations per token-id prompt, on the served adapter if there is one, tagged with the version
        and adapter that produced them; waits out an update, refuses while refusing."""
        with self.replica.request() as serving:
            return self.engine.generate(
                prompts, max_tokens, prompt_logprobs=prompt_logprobs, temperature=temperature, n=n, seed=seed,
                serving=serving,
            )
