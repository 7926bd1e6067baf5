"""vLLM's `AsyncLLM` as a refit replica: continuous batching, engine core in its own process.

For RL frameworks that serve many concurrent requests. `AsyncReplica(llm)`
gives an async Ray actor every replica method as a coroutine: the update
steps are `ReplicaCore`'s (refit/engine/replica.py), run one at a time in
submission order on a thread of their own, while the actor's event loop
keeps serving; `AsyncLLMAdapter` hands the core's engine calls back to that
loop. The engine core always runs in a process of its own, so bytes can
only arrive over a transport that bypasses vLLM's RPC (`collective`,
`ipc`); `check` refuses `ray`.

Each `serve` call is one request. An update:

1. holds new requests at the adapter's gate, outside vLLM;
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
version served when it was admitted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from refit.adapters import AdapterWeights, ServedAdapter
from refit.engine.config import EngineConfig
from refit.engine.lifecycle import FinishedUpdate, Phase, ReplicaStatus
from refit.engine.llm import checked_before_start, core_died, gone_if_core_died
from refit.engine.lora import lora_rank_of
from refit.engine.replica import EngineFacts, Generation, ReplicaCore, ReplicaObservation, delegate_to_replica
from refit.engine.spec_decode import spec_decode_counts
from refit.engine.worker_rpc import TYPED_CALL, refuse_engine_without_refit, results_of
from refit.errors import EngineGoneError, EngineHungError, ReplicaRefusingError, SyncTimeoutError
from refit.import_heap import collector_paused, freeze_import_heap
from refit.plan.config import Pause, SyncConfig
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.provenance import ScaleRecord
from refit.tokens import token_prompts
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.transport.kinds import TransportKind
from refit.verification.probe import ProbeRequest

__all__ = ["AsyncLLMAdapter", "AsyncReplica", "AsyncReplicaMethods", "Completion", "async_llm_replica", "start_async_llm"]

_RUN_MARGIN_S = 5.0
"""How much longer than the sync's deadline the update's thread waits for a call on the engine's loop."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's continuation, and the weights that produced it.

    `version`: the refit version served when the request was admitted (None:
    the weights the engine started with); with `pause="wait"` every token
    of it comes from those weights. `adapter`: likewise, the LoRA adapter
    (an adapter swap never moves a running request to another one). `aborted`: an update ended it early
    (`pause="abort"`); its tokens so far are kept.
    """

    token_ids: list[int]
    logprobs: list[float]
    version: int | None
    aborted: bool = False
    prompt_logprobs: list[float | None] | None = None
    adapter: ServedAdapter | None = None  # the LoRA adapter served when it was admitted, which it ran with


def start_async_llm(config: EngineConfig) -> Any:
    """Start the `AsyncLLM` that `config` describes, refusing on a CPU one the node cannot hold."""
    on_gpu = checked_before_start(config)
    with collector_paused():
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    freeze_import_heap()
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**config.llm_kwargs(on_gpu=on_gpu)))


def async_llm_replica(llm: Any) -> AsyncReplica:
    """`llm` (a running `AsyncLLM` started with `refit.engine_kwargs()` merged into its arguments) as a replica
    a `refit.Syncer` can sync, for an async Ray actor to hold and delegate the replica methods to."""
    return AsyncReplica(llm)


class AsyncReplica:
    """A running `AsyncLLM` (started with refit's engine arguments) as a replica, for an async Ray actor.

    Hold one in the actor and delegate the `refit.RolloutReplica` methods
    (and `serve` for requests) to it; `actors.AsyncRolloutActor` does.
    Create it in the actor's constructor: Ray runs an async actor's constructor on its default concurrency group's
    loop, where the `AsyncLLM` then runs (`AsyncLLMAdapter.adopt_loop`), whichever loop a request or a step comes
    from.
    """

    def __init__(self, llm: Any) -> None:
        self.engine = AsyncLLMAdapter(llm)
        self.core = ReplicaCore(self.engine)
        self._steps = ThreadPoolExecutor(1, thread_name_prefix="refit-update")  # in submission order
        # An async actor's constructor runs on its default concurrency group's loop: the `AsyncLLM` is used there.
        self.engine.adopt_loop(_running_loop())

    async def _step(self, method: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        self.engine.adopt_loop(loop)
        return await loop.run_in_executor(self._steps, method, *args)

    # -- observation (never waits) ----------------------------------------------------
    def describe(self) -> RolloutModelInfo:
        return self.core.describe()

    def status(self) -> ReplicaStatus:
        return self.core.status()

    def transport_ranks(self) -> int:
        return self.core.transport_ranks()

    def transports(self) -> dict:
        return self.core.transports()

    def transport_group(self) -> str | None:
        return self.core.transport_group()

    def last_update(self) -> dict | None:
        return self.core.last_update()

    def base_digest(self, transport: str) -> str | None:
        return self.core.base_digest(transport)

    async def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing)."""
        self.engine.adopt_loop(asyncio.get_running_loop())
        return await asyncio.to_thread(self.core.scale_records)

    # -- serving -------------------------------------------------------------------------
    async def serve(
        self, prompt: Sequence[int], max_tokens: int = 8, *, temperature: float = 0.0, seed: int | None = None
    ) -> Completion:
        """One request: its tokens, logprobs, the version that produced them, and whether an update aborted it.

        Awaitable from any event loop: an actor that serves requests in a concurrency group of their own (so that
        requests held during an update never take the slots the sync's calls need) awaits it on that group's loop,
        and the request runs on the engine's (`AsyncLLMAdapter.loop`).
        """
        here = asyncio.get_running_loop()
        request = self.engine.serve(prompt, max_tokens, self.core, temperature=temperature, seed=seed)
        engine_loop = self.engine.adopt_loop(here)
        if engine_loop is here:
            return await request
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(request, engine_loop))

    # -- the update steps (ReplicaCore's, in submission order) --------------------------------
    async def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        await self._step(self.core.join_transport, rendezvous, member_offset, sync_id)

    async def leave_transport(self, group_id: str | None = None) -> None:
        await self._step(self.core.leave_transport, group_id)

    async def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        return await self._step(self.core.begin_update, plan, sync_id, config)

    async def load_bucket(
        self, sync_id: str, version: int, bucket: list[BucketContents], next_bucket_bytes: list[int | None] | None = None
    ) -> float:
        return await self._step(self.core.load_bucket, sync_id, version, bucket, next_bucket_bytes)

    async def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        return await self._step(self.core.finish_update, sync_id, version, probe)

    async def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        return await self._step(self.core.abort_update, sync_id, reason)

    async def stage_adapter(self, sync_id: str, version: int, adapter: AdapterWeights, timeout_s: float) -> str:
        return await self._step(self.core.stage_adapter, sync_id, version, adapter, timeout_s)

    async def serve_adapter(self, sync_id: str, version: int) -> dict[str, Any]:
        return await self._step(self.core.serve_adapter, sync_id, version)

    async def unstage_adapter(self, sync_id: str, version: int) -> None:
        await self._step(self.core.unstage_adapter, sync_id, version)


class AsyncLLMAdapter:
    """`ReplicaCore`'s access to an `AsyncLLM`, and the request gate (see the module docstring).

    The core calls it from its update thread; each call runs a coroutine on
    `loop`, the event loop that serves requests, and waits for it.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        refuse_engine_without_refit(llm.vllm_config)
        self.facts = EngineFacts.of(llm.vllm_config)
        self.lora_rank = lora_rank_of(llm.vllm_config)
        self.worker_calls_beside_requests = True  # they queue in the engine core between its steps
        self.loop: asyncio.AbstractEventLoop | None = None  # where the `AsyncLLM` is used: `adopt_loop`
        self._gate = asyncio.Event()  # set: requests may enter the engine
        self._gate.set()
        self._admitting = 0  # requests past the gate whose add has not yet reached the engine core
        self._in_flight = 0  # requests past the gate that have not finished
        self._admitted = asyncio.Condition()
        self.timeout_s = SyncConfig().timeout_s  # the last sync's deadline, from `hold_requests`; its default before any

    def adopt_loop(self, loop: asyncio.AbstractEventLoop | None) -> asyncio.AbstractEventLoop | None:
        """The loop every use of the `AsyncLLM` runs on: the first one offered, kept for the engine's life.

        Why one loop: an `AsyncLLM` answers requests through a task and queues of the loop its first request came
        from, and Ray runs each concurrency group of an async actor on a loop of its own. A sync's calls and users'
        requests may arrive on different ones; both are handed to this one. A loop that closed (it served a
        constructor's `asyncio.run`) is replaced by the next offered; an engine that served requests there would not
        answer on another (vLLM's output task died with that loop), so make the replica where the engine will run.
        """
        if self.loop is None or self.loop.is_closed():
            self.loop = loop
        return self.loop

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """`coroutine` on the replica's loop, waited for from the update's thread within the sync's deadline.

        Why a deadline here too: the update's thread holds the core's lock while it waits, and the lease watchdog
        needs that lock to close an update whose driver is gone; an engine core that never answers would keep the
        gate shut, and every request held, for good. Calls between updates (adapter swaps, scale records) hold it
        too, so they keep the last sync's deadline.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:  # a margin over the deadline, so that a step's own deadline (the drain's) is the one that fires
            with gone_if_core_died(self.llm.engine_core):
                return future.result(timeout=self.timeout_s + _RUN_MARGIN_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EngineHungError(f"the AsyncLLM's engine did not answer within {self.timeout_s:.0f} s "
                                  "(SyncConfig.timeout_s); it is hung or overloaded") from None

    # -- requests (on the loop) ---------------------------------------------------------
    async def serve(self, prompt: Sequence[int], max_tokens: int, core: ReplicaCore, *,
                    temperature: float = 0.0, seed: int | None = None) -> Completion:
        """One user request, admitted at the gate and tagged with the version and adapter served when it was."""
        while True:
            await self._gate.wait()  # an update holds new requests here
            state = core.status()
            if state.phase is Phase.REFUSING:
                raise ReplicaRefusingError(f"this replica refuses to serve: {state.reason}")
            if state.phase is Phase.SERVING and self._gate.is_set():
                break
            await asyncio.sleep(0.01)  # never spin: the update closes the gate before its state says updating
        self._admitting += 1  # no await since the gate check: an update cannot slip in between
        self._in_flight += 1
        try:
            with core.adapters.using() as adapter:  # loaded until the request ends
                try:
                    queue = await self._admit(prompt, max_tokens, temperature=temperature, seed=seed, adapter=adapter)
                finally:
                    self._admitting -= 1
                    await self._notify()
                return await self._collect(queue, state.served_version, adapter)
        finally:
            self._in_flight -= 1
            await self._notify()

    async def _notify(self) -> None:
        async with self._admitted:
            self._admitted.notify_all()

    async def _admit(self, prompt: Sequence[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                     prompt_logprobs: bool = False, adapter: ServedAdapter | None = None):
        """Send one request to the engine core; returns its output queue once the core has it in order.

        Split from `_collect` so a request counts as in the engine before an update's pause is sent after it.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        (checked,) = token_prompts([prompt], vocab_size=self.facts.vocab_size)
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=0, detokenize=False,
            prompt_logprobs=0 if prompt_logprobs else None, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        return await self.llm.add_request(uuid.uuid4().hex, {"prompt_token_ids": list(checked)}, params,
                                          lora_request=None if adapter is None else adapter.lora_request())

    async def _collect(self, queue, version: int | None, adapter: ServedAdapter | None = None) -> Completion:
        """Wait for the request's final output; abort it if the caller gives up."""
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
        return Completion(list(completion.token_ids), logprobs, version, completion.finish_reason == "abort", prompt, adapter)

    # -- the core's calls (from its update thread) -----------------------------------------
    def check(self, config: SyncConfig) -> None:
        """Refuse an engine whose core died (its transport: `transport_refusal`), before requests are held."""
        if (died := self.gone()) is not None:
            raise EngineGoneError(died)

    def transport_refusal(self, kind: TransportKind) -> str | None:
        if kind.traits.needs_core_in_process:
            return (f"transport={kind.name!r} hands tensors to vLLM's workers as RPC arguments, which an AsyncLLM's "
                    "engine core (always in its own process) cannot pass on; use SyncConfig(transport='collective'), or 'shm' on "
                    "the trainer's host")
        return None

    def call_workers(self, method: str, *args: Any) -> list:
        # The workers are in the engine core's process: errors come back as data, raised again here with their type.
        return results_of(self._run(self.llm.collective_rpc(TYPED_CALL, args=(method, *args))))

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, prompt_logprobs: bool = False) -> Generation:
        """One request per prompt, past the gate (the post-refit stage and the probe run while it is closed)."""

        async def each() -> list[Completion]:
            return [await self._collect(await self._admit(p, max_tokens, prompt_logprobs=prompt_logprobs), None)
                    for p in prompts]

        done = self._run(each())
        return Generation([c.token_ids for c in done], [c.logprobs for c in done],
                          [c.prompt_logprobs for c in done] if prompt_logprobs else None)

    def reset_prefix_cache(self) -> None:
        self._run(self.llm.reset_prefix_cache())

    def spec_decode_counts(self) -> tuple[int, int] | None:
        return spec_decode_counts(self.facts)

    def gone(self) -> str | None:
        return core_died(self.llm.engine_core)

    def mark_version(self, version: int) -> None:
        pass  # each `Completion` is tagged by the replica itself, with the version served when it was admitted

    def hold_requests(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # the sync's deadline bounds every wait on the engine from here (`_run`)
        self._run(self._set_gate(False))

    def release_requests(self, refusal: str | None = None) -> None:
        self._run(self._set_gate(True))

    async def _set_gate(self, open_: bool) -> None:
        if open_:
            self._gate.set()
        else:
            self._gate.clear()

    def pause(self, mode: Pause, timeout_s: float) -> None:
        """Steps 2 and 3 of the module docstring."""

        async def drain_then_pause() -> None:
            async with self._admitted:
                if mode is Pause.WAIT:
                    await self._admitted.wait_for(lambda: self._in_flight == 0)
                else:
                    await self._admitted.wait_for(lambda: self._admitting == 0)
            await self.llm.pause_generation(mode=str(mode), clear_cache=True)

        try:
            self._run(asyncio.wait_for(drain_then_pause(), timeout=timeout_s))
        except TimeoutError:
            raise SyncTimeoutError(
                f"requests in flight did not finish within {timeout_s:.0f} s (pause={str(mode)!r})"
            ) from None

    def resume(self) -> None:
        self._run(self.llm.resume_generation())


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@delegate_to_replica(coroutines=True)
class AsyncReplicaMethods(ReplicaObservation):
    """The methods `refit.Syncer` calls, handed to `self.replica` (an `AsyncReplica`), for an async rollout actor.

    Mix into an async actor that holds its own `AsyncLLM`: set
    `self.replica = refit.async_llm_replica(llm)` in its constructor and
    serve requests with `await self.replica.serve(...)`. The observation
    methods are `ReplicaObservation`'s (they never wait); the update steps
    and `scale_records` are coroutines awaiting the replica's, made from
    `refit.protocols.REPLICA_METHODS` (`refit.engine.replica.delegate_to_replica`).
    """

    replica: AsyncReplica
