"""`EngineFacts`: what a replica needs to know about its engine, read once from the engine's vLLM config.

A module of its own, below both ends of the worker RPC: the replica reads
them from an engine it holds (`EngineFacts.of(llm.vllm_config)`), and a
worker reads them for a replica that holds no engine (a `vllm serve` server,
`RefitWorkerExtension.refit_engine_facts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refit.plan.transfer_plan import RolloutModelInfo

__all__ = ["EngineFacts"]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the core needs to know about an engine, read once from its vLLM config (`EngineFacts.of`)."""

    model_info: RolloutModelInfo
    vocab_size: int
    workers: int  # vLLM workers, each a rank of a collective group
    fp8_kv_cache: bool
    initial_refusal: str | None  # why it must not serve before its first sync (a dummy load)

    @classmethod
    def of(cls, vllm_config: Any) -> EngineFacts:
        """From a running engine's `VllmConfig`, so an engine the user started is described as one refit started."""
        model_dir = vllm_config.model_config.model
        dummy = str(vllm_config.load_config.load_format) == "dummy"
        return cls(
            model_info=RolloutModelInfo.from_checkpoint(model_dir, from_files=not dummy),
            vocab_size=int(vllm_config.model_config.get_vocab_size()),
            workers=int(vllm_config.parallel_config.world_size),
            fp8_kv_cache=str(vllm_config.cache_config.cache_dtype).startswith("fp8"),
            initial_refusal=(
                "it started with load_format='dummy', so its weights and scales are placeholders; run a sync first"
                if dummy else None
            ),
        )
