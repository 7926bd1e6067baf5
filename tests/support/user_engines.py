"""Rollout actors written the way an RL framework writes them: its own engine, its own arguments, refit's replica held inside.

Not refit's actors: each constructs a `vllm.LLM` or an `AsyncLLM` itself,
merges `refit.engine_kwargs()` into its arguments, holds
`refit.llm_replica(llm)` / `refit.async_llm_replica(llm)` and takes the
methods `refit.Syncer` calls from `refit.ReplicaMethods` /
`refit.AsyncReplicaMethods` (as examples/own_engine.py does). Here, not in
a test module, because Ray must import the classes in the actors' processes.
"""

from __future__ import annotations

import os

import ray

import refit

ENGINE = {"load_format": "dummy", "kv_cache_dtype": "fp8_e4m3", "max_model_len": 128, "enforce_eager": True,
          "skip_tokenizer_init": True}
LORA_RANK = 8
"""What tests/sync/test_user_engines.py starts them with: serving LoRA adapters too (`refit.engine_kwargs(lora_rank=...)`)."""


@ray.remote(concurrency_groups={"serve": 1})
class UserLLMRollout(refit.ReplicaMethods):
    """A threaded actor with an in-process `vllm.LLM` (one request batch at a time, in a concurrency group of its own,
    as docs/own-engine.md says)."""

    def __init__(self, model_dir: str, lora_rank: int | None = None) -> None:
        """`lora_rank`: serve LoRA adapters up to that rank too (docs/lora.md)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=model_dir, **ENGINE, **refit.engine_kwargs(lora_rank=lora_rank))
        self.replica = refit.llm_replica(self.llm)

    @ray.method(concurrency_group="serve")
    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        with self.replica.request() as serving:  # on the adapter refit serves, if it serves one
            lora = serving.adapter.lora_request() if serving.adapter is not None else None
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
        done = [out.outputs[0] for out in outputs]
        return [list(c.token_ids) for c in done], [[s[t].logprob for s, t in zip(c.logprobs, c.token_ids)] for c in done]


@ray.remote(concurrency_groups={"serve": 1000})  # requests apart from refit's calls (docs/own-engine.md)
class UserAsyncLLMRollout(refit.AsyncReplicaMethods):
    """An async actor with an `AsyncLLM` (engine core in its own process, so synced over `transport="collective"`)."""

    def __init__(self, model_dir: str, lora_rank: int | None = None) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(model=model_dir, **ENGINE, **refit.engine_kwargs(lora_rank=lora_rank))
        self.llm = AsyncLLM.from_engine_args(args)
        self.replica = refit.async_llm_replica(self.llm)

    @ray.method(concurrency_group="serve")
    async def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        done = [await self.replica.serve(p, max_tokens) for p in prompts]
        return [c.token_ids for c in done], [c.logprobs for c in done]



@ray.remote(max_calls=1)  # the engine goes with the task's process
def replica_of_an_engine_without_refit(model_dir: str, kv_cache_bytes: int) -> str:
    """Start a `vllm.LLM` the way a user who forgot `refit.engine_kwargs()` would, and make it a replica: what refit
    said (the error's message), or "accepted"."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=model_dir, **ENGINE, kv_cache_memory_bytes=kv_cache_bytes)  # on a CPU vLLM would take 92% otherwise
    try:
        refit.llm_replica(llm)
    except refit.ConfigError as error:
        return str(error)
    return "accepted"


def kill_engine_core(rollout) -> int:
    """Kill every process `rollout`'s engine runs in beside the actor's own (an AsyncLLM's core and its workers), as
    the OOM killer would; returns how many. The actor lives on."""
    import psutil

    children = psutil.Process(os.getpid()).children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=30)
    return len(children)
