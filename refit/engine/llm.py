"""An in-process `vllm.LLM` as a refit replica: how refit starts one, and the adapter `ReplicaCore` drives it through.

`start_llm(config)` starts the engine an `EngineConfig` describes (refit's
worker extension and weight-transfer backend, memory sized for the node);
an `LLM` a user started with `refit.engine_kwargs()` merged into its
arguments is the same to refit. `LLMAdapter` gives `ReplicaCore`
(refit/engine/replica.py) what it needs of it: `collective_rpc` to the
workers, which reaches them in-process and in separate worker processes
(tensor parallel > 1), and generation. Whole batches: `generate` runs
inside the lifecycle's `request()`, so an update's begin waits for
requests in flight and holds new ones itself, and there is nothing to
pause. `llm_replica(llm)` is the two together.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from refit.engine.config import EngineConfig
from refit.engine.lora import lora_rank_of
from refit.engine.replica import EngineFacts, Generation, ReplicaCore, Serving
from refit.engine.spec_decode import spec_decode_counts
from refit.engine.worker_rpc import TYPED_CALL, refuse_engine_without_refit, results_of
from refit.errors import ConfigError, EngineError, EngineGoneError
from refit.import_heap import collector_paused, freeze_import_heap
from refit.plan.config import Pause, SyncConfig
from refit.tokens import token_prompts
from refit.transport.kinds import TransportKind

__all__ = ["LLMAdapter", "core_died", "gone_if_core_died", "llm_replica", "start_llm"]

# What a CPU engine process needs beside its weights and KV cache (Python,
# torch, vLLM, warm-up buffers), with a margin over what the tiny fixtures'
# engines take (docs/cpu.md).
_CPU_ENGINE_OVERHEAD_BYTES = 1 << 30


CORE_DIED = ("its engine core process died (vLLM's EngineDeadError), so it can never serve again; start a new engine "
             "in a new actor and add that with Syncer.add_replica")


def core_died(engine_core: Any) -> str | None:
    """`CORE_DIED` if vLLM's client `engine_core` saw its core's process die, else None (a core in this process dies
    with it: never). A core of its own (an `AsyncLLM`'s, or VLLM_ENABLE_V1_MULTIPROCESSING=1) can die while the
    replica's actor lives on."""
    return CORE_DIED if getattr(getattr(engine_core, "resources", None), "engine_dead", False) else None


@contextmanager
def gone_if_core_died(engine_core: Any) -> Iterator[None]:
    """A call on the engine that failed because its core died raises `EngineGoneError`: vLLM's EngineDeadError names
    no replica, and a fleet drops a gone one by name and syncs the others."""
    try:
        yield
    except Exception as error:
        if (died := core_died(engine_core)) is not None:
            raise EngineGoneError(died) from error
        raise


def start_llm(config: EngineConfig) -> Any:
    """Start the `vllm.LLM` that `config` describes, refusing on a CPU one the node cannot hold."""
    # The engine core runs in this process unless VLLM_ENABLE_V1_MULTIPROCESSING=1
    # says otherwise. Only the `ray` transport cares: it hands tensors to
    # the workers as RPC arguments, which a separate core process cannot
    # pickle on to them ("cannot pickle memoryview objects").
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    on_gpu = checked_before_start(config)
    with collector_paused():
        from vllm import LLM
    freeze_import_heap()
    kwargs = config.llm_kwargs(on_gpu=on_gpu)
    with _tokenizerless_chat_warmup_unlogged(kwargs):
        return LLM(**kwargs)


def llm_replica(llm: Any) -> ReplicaCore:
    """`llm` (a running `vllm.LLM` started with `refit.engine_kwargs()` merged into its arguments) as a replica
    a `refit.Syncer` can sync, for a Ray actor to hold and delegate the replica methods to.

    Run the actor's requests inside `replica.request()`, so an update waits
    for them and holds new ones. The `ray` transport needs the engine core in
    the actor's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); otherwise sync
    with `transport="collective"`.
    """
    return ReplicaCore(LLMAdapter(llm))


class LLMAdapter:
    """`ReplicaCore`'s access to an in-process `vllm.LLM` (see the module docstring)."""

    def __init__(self, llm: Any) -> None:
        from vllm.v1.engine.core_client import InprocClient

        self.llm = llm
        refuse_engine_without_refit(llm.llm_engine.vllm_config)
        self.facts = EngineFacts.of(llm.llm_engine.vllm_config)
        self.engine_core_in_process = isinstance(llm.llm_engine.engine_core, InprocClient)
        # Workers in this process raise their own errors; from another, vLLM's RPC keeps only the message, so the
        # errors come back as data (`refit_typed_call`) and are raised again with their type.
        self._workers_in_process = self.engine_core_in_process and llm.llm_engine.vllm_config.parallel_config.world_size == 1
        self.lora_rank = lora_rank_of(llm.llm_engine.vllm_config)
        # `collective_rpc` runs on the calling thread, beside a `generate` on another: never while one runs.
        self.worker_calls_beside_requests = False

    def check(self, config: SyncConfig) -> None:
        if (died := self.gone()) is not None:
            raise EngineGoneError(died)
        if config.pause is not Pause.WAIT:
            raise ConfigError(
                f"pause={str(config.pause)!r}: a vllm.LLM replica serves whole batches and always waits for them; "
                "an AsyncLLM replica (actors.AsyncRolloutActor) or a vllm serve server can abort requests in flight"
            )

    def transport_refusal(self, kind: TransportKind) -> str | None:
        if kind.traits.needs_core_in_process and not self.engine_core_in_process:
            return (f"transport={kind.name!r} hands tensors to vLLM's workers as RPC arguments, which needs the engine "
                    "core in the rollout's process, but this engine runs it in its own (VLLM_ENABLE_V1_MULTIPROCESSING=1); "
                    "use SyncConfig(transport='collective'), or 'shm' on the trainer's host")
        return None

    def call_workers(self, method: str, *args: Any) -> list:
        if self._workers_in_process:
            return self.llm.collective_rpc(method, args=args)
        with gone_if_core_died(self.llm.llm_engine.engine_core):
            return results_of(self.llm.collective_rpc(TYPED_CALL, args=(method, *args)))

    def reset_prefix_cache(self) -> None:
        with gone_if_core_died(self.llm.llm_engine.engine_core):
            self.llm.reset_prefix_cache()

    # Requests are the lifecycle's: `generate` runs inside `ReplicaCore.request()`, and the
    # update's begin has waited for every one in flight before it returns. Nothing to pause.
    def hold_requests(self, timeout_s: float) -> None:
        pass

    def pause(self, mode: Pause, timeout_s: float) -> None:
        pass

    def resume(self) -> None:
        pass

    def mark_version(self, version: int) -> None:
        pass  # versions are the replica's own (`status()`); vLLM's outputs here carry none

    def release_requests(self, refusal: str | None = None) -> None:
        pass

    def spec_decode_counts(self) -> tuple[int, int] | None:
        return spec_decode_counts(self.facts)

    def gone(self) -> str | None:
        return core_died(self.llm.llm_engine.engine_core)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, *, prompt_logprobs: bool = False,
        temperature: float = 0.0, n: int = 1, seed: int | None = None, serving: Serving | None = None,
    ) -> Generation:
        """`n` continuations per token-id prompt (greedy at temperature 0); `serving`: what `ReplicaCore.request()`
        admitted the batch on, its adapter applied and both tagged on the result (None: the base, untagged)."""
        from vllm import SamplingParams

        checked = token_prompts(prompts, vocab_size=self.facts.vocab_size)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, n=n, seed=seed, logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None, detokenize=False,
        )
        adapter = None if serving is None else serving.adapter
        try:
            with gone_if_core_died(self.llm.llm_engine.engine_core):
                outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in checked], params, use_tqdm=False,
                                            lora_request=None if adapter is None else adapter.lora_request())
        except BaseException:
            self._abort_unfinished()
            raise
        token_ids, logprobs, prompt_lps = [], [], []
        for out in outputs:
            for completion in out.outputs:
                token_ids.append(list(completion.token_ids))
                logprobs.append([step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)])
                if prompt_logprobs:
                    prompt_lps.append([
                        None if step is None else step[tok].logprob
                        for step, tok in zip(out.prompt_logprobs, out.prompt_token_ids)
                    ])
        return Generation(token_ids, logprobs, prompt_lps if prompt_logprobs else None,
                          None if serving is None else serving.version, adapter)

    def _abort_unfinished(self) -> None:
        # A request that raised inside the forward stays scheduled; left there,
        # it holds its KV blocks and every later step runs it again.
        engine = self.llm.llm_engine
        unfinished = list(engine.output_processor.request_states)
        if unfinished:
            engine.abort_request(unfinished, internal=True)


# `vllm.LLM.__init__` always warms up the chat template (vLLM 0.32:
# vllm/entrypoints/llm.py, `self.renderer.warmup(...)`); no engine argument
# skips it. Rendering a chat needs the tokenizer, which `skip_tokenizer_init`
# (always set by refit: rollouts exchange token ids) leaves out, so the
# renderer raises "Tokenizer not available when `skip_tokenizer_init=True`"
# and vLLM logs "Chat template warmup failed" with that traceback at WARNING
# (vllm/renderers/base.py, `BaseRenderer.warmup`), a failure of nothing refit
# uses. While the engine starts, a filter on that one logger drops exactly
# that record: that message, caused by that ValueError. Any other warmup
# failure, and every other line, is still logged at vLLM's own levels.
# (`AsyncLLM` runs no chat-template warmup, so `start_async_llm` needs none.)
_CHAT_WARMUP_LOGGER = "vllm.renderers.base"
_CHAT_WARMUP_FAILED = "Chat template warmup failed"


class _TokenizerlessChatWarmupFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            record.name == _CHAT_WARMUP_LOGGER and record.msg == _CHAT_WARMUP_FAILED
            and isinstance(error, ValueError) and "skip_tokenizer_init" in str(error)
        )


@contextmanager
def _tokenizerless_chat_warmup_unlogged(llm_kwargs: Mapping[str, object]) -> Iterator[None]:
    """Start `vllm.LLM(**llm_kwargs)` inside this: without a tokenizer, its chat warmup's failure is not logged."""
    if not llm_kwargs.get("skip_tokenizer_init"):
        yield
        return
    logger, drop = logging.getLogger(_CHAT_WARMUP_LOGGER), _TokenizerlessChatWarmupFilter()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def checked_before_start(config: EngineConfig) -> bool:
    """What every engine refit starts is checked for before vLLM starts it (and aborts, far from the cause): its
    model directory, and on a CPU whether the node can hold it. Returns whether it runs on a GPU."""
    config.check_model_directory()
    # EngineConfig is the one place that sizes the KV cache; vLLM's legacy variable would silently override it
    # (in this process, and in an engine core process started from it).
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _refuse_if_it_cannot_fit(config)
    return on_gpu


def _refuse_if_it_cannot_fit(config: EngineConfig) -> None:
    """On a CPU, refuse an engine the node cannot hold, before vLLM starts (and aborts) it."""
    import psutil

    kv_bytes = config.kv_cache_bytes_on(False)
    weights = sum(p.stat().st_size for p in Path(config.model).glob("*.safetensors"))
    needed = kv_bytes + weights + _CPU_ENGINE_OVERHEAD_BYTES
    available = psutil.virtual_memory().available
    if needed > available:
        gib = 2**30
        raise EngineError(
            f"this engine needs about {needed / gib:.1f} GiB (KV cache {kv_bytes / gib:.1f} GiB from "
            f"EngineConfig.kv_cache_bytes, weights {weights / gib:.1f} GiB, engine {_CPU_ENGINE_OVERHEAD_BYTES / gib:.1f} GiB) "
            f"but this node has {available / gib:.1f} GiB available; lower EngineConfig.kv_cache_bytes, "
            "place the engine on another node, or stop another engine"
        )
