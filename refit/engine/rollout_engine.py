"""A running vLLM engine that refit can update in place.

`RolloutEngine` owns one `vllm.LLM` started with refit's weight-transfer
backend and drives each update step through `collective_rpc`, which reaches
the model both in-process and in separate worker processes (tensor parallel
> 1) or a separate engine-core process: `begin_update` -> `load` (tensors,
the `ray` transport) or `receive` (a table of contents, the `collective` and
`ipc` transports) per bucket -> `finish_update` (completeness checked,
reload finalized) -> `apply_kv_scales` (the post-refit stage), or
`abandon_update`. Which step may run when is not its business: that is the
replica's `UpdateLifecycle` (refit/engine/lifecycle.py). It holds no Ray
state; `actors.RolloutActor` wraps it for Ray.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from refit.engine.config import EngineConfig
from refit.errors import ConfigError, EngineError
from refit.plan.config import Transport
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import KvScalePolicy, ScaleRecord, ScaleSource
from refit.tokens import token_prompts
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.verification.probe import ProbeRequest, ProbeResult, compare, thresholds_for

__all__ = ["Generation", "RolloutEngine"]

# What a CPU engine process needs beside its weights and KV cache (Python,
# torch, vLLM, warm-up buffers): measured ~0.8 GiB for the tiny fixtures.
_CPU_ENGINE_OVERHEAD_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Generation:
    """Continuations with their log-probabilities, `n` per prompt, prompt-major."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each generated token
    prompt_logprobs: list[list[float | None]] | None


class RolloutEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.check_model_directory()
        # The engine core runs in this process unless VLLM_ENABLE_V1_MULTIPROCESSING=1
        # says otherwise. Only the `ray` transport cares: it hands tensors to
        # the workers as RPC arguments, which a separate core process cannot
        # pickle on to them ("cannot pickle memoryview objects").
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.engine_core_in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        # EngineConfig is the one place that sizes the KV cache; vLLM's legacy
        # variable would silently override it.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            _refuse_if_it_cannot_fit(config)
        from vllm import LLM

        self.config = config
        kwargs = config.llm_kwargs(on_gpu=on_gpu)
        with _tokenizerless_chat_warmup_unlogged(kwargs):
            self.llm = LLM(**kwargs)
        self.model_info = RolloutModelInfo.from_checkpoint(config.model, from_files=config.load_format != "dummy")
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.workers = int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def check_transport(self, transport: Transport) -> None:
        """Refuse a transport that cannot reach this engine's workers."""
        if transport is Transport.RAY and not self.engine_core_in_process:
            raise ConfigError(
                "transport='ray' hands tensors to vLLM's workers as RPC arguments, which needs the engine core in "
                "the rollout's process, but this engine runs it in its own (VLLM_ENABLE_V1_MULTIPROCESSING=1); "
                "use SyncConfig(transport='collective')"
            )

    def begin_update(self, plan: TransferPlan, transport: Transport) -> None:
        """Put every layer in loadable form; over `collective` or `ipc`, tell the workers the plan of what arrives."""
        self.check_transport(transport)
        self.llm.collective_rpc("start_weight_update")
        if transport is not Transport.RAY:
            self.llm.collective_rpc("refit_expect_plan", args=(pickle.dumps(plan), str(transport)))

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]], version: int, *, verify: bool = False) -> None:
        """Load one bucket of tensors in the form vLLM's loaders take (`ray`); `verify`: read the scales back at finish."""
        self.llm.collective_rpc("update_weights", args=({"version": version, "tensors": list(tensors), "verify": verify},))

    def receive(self, contents: Sequence[BucketContents], next_bucket_bytes: Sequence[int | None], version: int, *,
                verify: bool = False) -> None:
        """Load one bucket whose bytes the workers receive over the transport (a part per sending rank); only
        the contents cross the RPC."""
        self.llm.collective_rpc("update_weights", args=(receive_info(contents, next_bucket_bytes, version, verify),))

    def streamed(self) -> list[str]:
        """Checkpoint names of every tensor the open update loaded."""
        return self.llm.collective_rpc("refit_streamed")[0]

    def join_group(self, rendezvous: Rendezvous, member_offset: int) -> None:
        """Every worker joins the collective group as member `member_offset` + its rank; blocks until the group is whole."""
        self.llm.collective_rpc("refit_join_group", args=rendezvous_args(rendezvous, member_offset))

    def leave_group(self) -> None:
        self.llm.collective_rpc("refit_leave_group")

    def probe(self, request: ProbeRequest) -> ProbeResult:
        """Score the probe prompts and compare with the trainer's logprobs, at this engine's precision's thresholds."""
        scored = self.generate([list(p) for p in request.prompts], max_tokens=1, prompt_logprobs=True)
        fp8_kv = str(self.llm.llm_engine.vllm_config.cache_config.cache_dtype).startswith("fp8")
        thresholds = thresholds_for(self.model_info.quantization_config is not None, fp8_kv)
        return compare([row[1:] for row in scored.prompt_logprobs], request.reference, thresholds)

    def finish_update(self) -> None:
        """Refuse an incomplete update (reload left open for `abandon_update`), else finalize it."""
        self.llm.collective_rpc("finish_weight_update")

    def apply_kv_scales(self, policy: KvScalePolicy, calibration_prompts: Sequence[Sequence[int]], version: int) -> list[str]:
        """The post-refit stage; returns the attention scales written ("module.scale").

        Then drops the prefix cache: cached prefixes hold K/V computed by the old weights.
        """
        measured = None
        if policy is KvScalePolicy.RECOMPUTE:
            # The calibration pass itself runs through an FP8 KV cache, which
            # refuses dummy scales: make placeholders valid (1.0) first.
            self.llm.collective_rpc("refit_apply_kv_policy", args=(str(KvScalePolicy.AUTO), version, None))
            self.llm.collective_rpc("refit_start_amax")
            self.generate(calibration_prompts, max_tokens=1)
            # Tensor-parallel ranks see different heads: the amax is the max over ranks.
            measured = max_over_ranks(self.llm.collective_rpc("refit_stop_amax"))
        written = self.llm.collective_rpc("refit_apply_kv_policy", args=(str(policy), version, measured))[0]
        self.llm.reset_prefix_cache()
        return written

    def abandon_update(self) -> None:
        """Close a failed update: layers that received nothing get their old tensors back."""
        self.llm.collective_rpc("refit_abandon_update")

    def scale_records(self) -> list[ScaleRecord]:
        return scale_records_from_rows(self.llm.collective_rpc("refit_scale_records")[0])

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, *, prompt_logprobs: bool = False,
        temperature: float = 0.0, n: int = 1, seed: int | None = None,
    ) -> Generation:
        """`n` continuations per token-id prompt (greedy at temperature 0)."""
        from vllm import SamplingParams

        checked = token_prompts(prompts, vocab_size=self.vocab_size)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, n=n, seed=seed, logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None, detokenize=False,
        )
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in checked], params, use_tqdm=False)
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
        return Generation(token_ids, logprobs, prompt_lps if prompt_logprobs else None)

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
# (`AsyncLLM` runs no chat-template warmup, so `AsyncRolloutEngine` needs none.)
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


def max_over_ranks(per_rank: list[list[tuple[str, str, float]]]) -> list[tuple[str, str, float]]:
    """Attention amax measured by each tensor-parallel worker (each sees its own heads): the max over them."""
    amax: dict[tuple[str, str], float] = {}
    for rows in per_rank:
        for module, scale, value in rows:
            amax[(module, scale)] = max(amax.get((module, scale), 0.0), value)
    return [(module, scale, value) for (module, scale), value in amax.items()]


def rendezvous_args(rendezvous: Rendezvous, member_offset: int) -> tuple:
    """`refit_join_group`'s arguments as plain data (vLLM's RPC carries no refit classes)."""
    return (rendezvous.to_plain(), member_offset)


def receive_info(contents: Sequence[BucketContents], next_bucket_bytes: Sequence[int | None], version: int, verify: bool) -> dict:
    """The `update_weights` payload of a bucket whose bytes come over the transport: plain data only."""
    return {"version": version, "contents": [part.to_plain() for part in contents],
            "next_bucket_bytes": list(next_bucket_bytes), "verify": verify}


def scale_records_from_rows(rows: list[dict]) -> list[ScaleRecord]:
    return [ScaleRecord(**{**row, "source": ScaleSource(row["source"])}) for row in rows]
