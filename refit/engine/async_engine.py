"""A vLLM `AsyncLLM` that refit updates in place: continuous batching, engine core in its own process.

The asynchronous twin of `RolloutEngine` (same update steps, same worker
extension, same weight-transfer backend), for RL frameworks that serve many
concurrent requests. Its engine core always runs in a process of its own,
so bytes can only arrive over a transport that bypasses vLLM's RPC
(`collective`, `ipc`); `check_transport` refuses `ray`.

Pausing is vLLM's own (`pause_generation`): `wait` lets requests in flight
finish on the old weights, `abort` ends them, marked aborted. Holding new
requests during an update, and tagging each output with the version that
produced it, is the actor's business (`actors.AsyncRolloutActor`).
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit.engine.config import EngineConfig
from refit.engine.rollout_engine import max_over_ranks, receive_info, rendezvous_args, scale_records_from_rows
from refit.errors import ConfigError
from refit.plan.config import Pause, Transport
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import KvScalePolicy, ScaleRecord
from refit.tokens import token_prompts
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.verification.probe import ProbeRequest, ProbeResult, compare, thresholds_for

__all__ = ["AsyncRolloutEngine", "Completion"]


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's continuation, and the weights that produced it.

    `version`: the refit version served when the request was admitted (None:
    the weights the engine started with); with `pause="wait"` every token
    of it comes from those weights. `aborted`: an update ended it early
    (`pause="abort"`); its tokens so far are kept.
    """

    token_ids: list[int]
    logprobs: list[float]
    version: int | None
    aborted: bool = False
    prompt_logprobs: list[float | None] | None = None


class AsyncRolloutEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.check_model_directory()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.llm_kwargs(on_gpu=torch.cuda.is_available())))
        self.model_info = RolloutModelInfo.from_checkpoint(config.model, from_files=config.load_format != "dummy")
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self.workers = int(self.llm.vllm_config.parallel_config.world_size)
        self._fp8_kv = str(self.llm.vllm_config.cache_config.cache_dtype).startswith("fp8")

    # -- requests ------------------------------------------------------------------
    async def admit(self, prompt: Sequence[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                    prompt_logprobs: bool = False):
        """Send one request to the engine core; returns its output queue once the core has it in order.

        Split from `collect` so the caller can count a request as in the
        engine before an update's pause is sent after it.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        (checked,) = token_prompts([prompt], vocab_size=self.vocab_size)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0, detokenize=False,
            prompt_logprobs=0 if prompt_logprobs else None, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        return await self.llm.add_request(uuid.uuid4().hex, {"prompt_token_ids": list(checked)}, params)

    async def collect(self, queue, version: int | None) -> Completion:
        """Wait for the request's final output; abort it if the caller gives up."""
        import asyncio

        try:
            while True:
                out = queue.get_nowait() or await queue.get()
                if out.finished:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            await self.llm.abort(queue.request_id, internal=True)
            raise
        completion = out.outputs[0]
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs or [], completion.token_ids)]
        prompt = None
        if out.prompt_logprobs is not None:
            prompt = [None if step is None else step[tok].logprob for step, tok in zip(out.prompt_logprobs, out.prompt_token_ids)]
        return Completion(list(completion.token_ids), logprobs, version, completion.finish_reason == "abort", prompt)

    async def generate(self, prompt: Sequence[int], max_tokens: int, version: int | None, **kwargs) -> Completion:
        return await self.collect(await self.admit(prompt, max_tokens, **kwargs), version)

    # -- update steps (see RolloutEngine for what each does) ---------------------
    def check_transport(self, transport: Transport) -> None:
        if transport is Transport.RAY:
            raise ConfigError(
                "transport='ray' hands tensors to vLLM's workers as RPC arguments, which an AsyncLLM's engine core "
                "(always in its own process) cannot pass on; use SyncConfig(transport='collective')"
            )

    async def pause(self, mode: Pause) -> None:
        """Stop scheduling: requests in flight finish (`wait`) or end aborted (`abort`); later ones are held."""
        await self.llm.pause_generation(mode=str(mode), clear_cache=True)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def begin_update(self, plan: TransferPlan, transport: Transport) -> None:
        self.check_transport(transport)
        await self.llm.collective_rpc("start_weight_update")
        await self.llm.collective_rpc("refit_expect_plan", args=(pickle.dumps(plan), str(transport)))

    async def receive(self, contents: Sequence[BucketContents], next_bucket_bytes: Sequence[int | None], version: int, *,
                      verify: bool) -> None:
        await self.llm.collective_rpc("update_weights", args=(receive_info(contents, next_bucket_bytes, version, verify),))

    async def streamed(self) -> list[str]:
        return (await self.llm.collective_rpc("refit_streamed"))[0]

    async def finish_update(self) -> None:
        await self.llm.collective_rpc("finish_weight_update")

    async def apply_kv_scales(self, policy: KvScalePolicy, calibration_prompts: Sequence[Sequence[int]], version: int) -> list[str]:
        """The post-refit stage (needs the scheduler running: the recompute policy generates)."""
        measured = None
        if policy is KvScalePolicy.RECOMPUTE:
            await self.llm.collective_rpc("refit_apply_kv_policy", args=(str(KvScalePolicy.AUTO), version, None))
            await self.llm.collective_rpc("refit_start_amax")
            for prompt in calibration_prompts:
                await self.generate(prompt, 1, None)
            measured = max_over_ranks(await self.llm.collective_rpc("refit_stop_amax"))
        written = (await self.llm.collective_rpc("refit_apply_kv_policy", args=(str(policy), version, measured)))[0]
        await self.llm.reset_prefix_cache()
        return written

    async def probe(self, request: ProbeRequest) -> ProbeResult:
        scored = [await self.generate(list(p), 1, None, prompt_logprobs=True) for p in request.prompts]
        thresholds = thresholds_for(self.model_info.quantization_config is not None, self._fp8_kv)
        return compare([c.prompt_logprobs[1:] for c in scored], request.reference, thresholds)

    async def abandon_update(self) -> None:
        await self.llm.collective_rpc("refit_abandon_update")

    async def join_group(self, rendezvous: Rendezvous, member_offset: int) -> None:
        await self.llm.collective_rpc("refit_join_group", args=rendezvous_args(rendezvous, member_offset))

    async def leave_group(self) -> None:
        await self.llm.collective_rpc("refit_leave_group")

    async def scale_records(self) -> list[ScaleRecord]:
        return scale_records_from_rows((await self.llm.collective_rpc("refit_scale_records"))[0])
