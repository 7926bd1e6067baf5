"""One replica's side of a sync, whatever engine it runs and however that engine is reached.

`ReplicaCore` is the one implementation of the update lifecycle on the
replica: `begin_update` -> `load_bucket` per bucket -> `finish_update`
(completeness, the reload finalized, scales read back, the post-refit KV
stage, the probe), or `abort_update` from any point; the lease watchdog
that closes an update whose sync stopped calling; and what `refit inspect`
shows. Which step may run when is the `UpdateLifecycle`'s
(refit/engine/lifecycle.py); what the workers do is `WorkerCalls`'
(refit/engine/worker_rpc.py).

An engine takes part only through an `EngineAdapter`: how to call its
workers, how to generate, and how to hold, pause, resume and release its
requests around an update. `LLMAdapter` (refit/engine/llm.py) adapts an
in-process `vllm.LLM`, `AsyncLLMAdapter` (refit/engine/async_llm.py) an
`AsyncLLM`, `ServerAdapter` (refit/engine/server.py) a `vllm serve` server
over HTTP. Every method here blocks: an actor runs the update steps on one
thread, in submission order (an async actor: on an executor thread, with
the adapter handing its coroutines to the actor's event loop).

Every failure inside a step closes the update here, on the replica, and
leaves it serving its old version (nothing loaded) or refusing; the
driver's `abort_update` then finds nothing open. A replica never waits for
the driver to clean up after it, since that driver may be gone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from refit.adapters import AdapterSlots, AdapterWeights, ServedAdapter, check_adapter
from refit.engine.facts import EngineFacts
from refit.engine.lifecycle import FinishedUpdate, Phase, ReplicaStatus, UpdateLifecycle
from refit.engine.worker_rpc import WorkerCalls
from refit.errors import (
    ConfigError,
    InvalidTensorError,
    LifecycleError,
    PlanMismatchError,
    SyncTimeoutError,
    VerificationError,
)
from refit.plan.config import Pause, SyncConfig, Verify
from refit.plan.data_path import loadable_tensors
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
from refit.protocols import REPLICA_METHODS, ConcurrencyGroup, FullRolloutReplica, as_declared
from refit.provenance import KvScalePolicy, ScaleRecord
from refit.tokens import token_prompts
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import Rendezvous
from refit.transport.delta import ReplicaBase
from refit.transport.kinds import AUTO_CANDIDATES, TransportKind, transport_kind
from refit.transport.shm import host_identity
from refit.verification import ProbeRequest, refuse_partial
from refit.verification.probe import ProbeResult, compare, probe_prompts, thresholds_for

__all__ = [
    "EngineAdapter", "EngineFacts", "Generation", "ReplicaCore", "ReplicaMethods", "ReplicaObservation", "Serving",
    "delegate_to_replica",
]

log = logging.getLogger("refit.engine")

_WATCHDOG_PERIOD_S = 0.5
_UNLOAD_WAIT_S = 60.0  # for the requests in flight, before a retired adapter is unloaded from an engine that must be idle

_C = TypeVar("_C")


@dataclass(frozen=True, slots=True)
class Generation:
    """Continuations with their log-probabilities, `n` per prompt, prompt-major."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each generated token
    prompt_logprobs: list[list[float | None]] | None
    version: int | None = None  # of the weights that produced them (None: what the engine started with)
    adapter: ServedAdapter | None = None  # the LoRA adapter they ran with, if any


DRAFT_PROBE_TOKENS = 16
"""Tokens generated per probe prompt to measure a draft model's acceptance after a sync."""


class EngineAdapter(Protocol):
    """How the core reaches one engine. Every method blocks until the engine has done it."""

    facts: EngineFacts

    def transport_refusal(self, kind: TransportKind) -> str | None:
        """Why this engine cannot take `kind`'s bytes, or None (`begin_update` raises it; `transports` asks it
        without a sync)."""

    def check(self, config: SyncConfig) -> None:
        """Refuse a sync this engine cannot take part in for another reason than its transport (a pause mode, a
        server that restarted). It changes nothing: a rival sync, which the update lifecycle refuses after it, asks
        it too."""

    def call_workers(self, method: str, *args: Any) -> list:
        """Call `method` on every worker (vLLM's `collective_rpc`); one result per worker."""

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, prompt_logprobs: bool = False) -> Generation:
        """Greedy continuations, run now: the post-refit stage and the probe call it while users' requests are held."""

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes: they hold K/V the old weights computed."""

    def hold_requests(self, timeout_s: float) -> None:
        """New requests wait from now on (before the update may change anything). Called once the update is this
        sync's: `timeout_s`, its deadline, bounds the engine's own calls until the next update's hold."""

    def pause(self, mode: Pause, timeout_s: float) -> None:
        """Requests in flight finish (`wait`) or end marked aborted (`abort`); the scheduler stops."""

    def resume(self) -> None:
        """The scheduler runs again (users' requests are still held)."""

    def mark_version(self, version: int) -> None:
        """The update to `version` is complete and verified: an engine that labels its outputs with a weight
        version (a `vllm serve` server's `/update_weight_version`) takes it now, before requests are released."""

    def release_requests(self, refusal: str | None = None) -> None:
        """Held requests go on: served by the new version, or by the old one, or refused with `refusal` (why the
        replica refuses). An engine whose requests pass through the core is refused by the lifecycle itself; a server,
        whose users reach it directly, must refuse them itself."""

    def spec_decode_counts(self) -> tuple[int, int] | None:
        """(draft tokens proposed, draft tokens accepted) since the engine started, or None where it has no draft
        model or does not count them."""

    def gone(self) -> str | None:
        """Why the engine no longer serves what this replica recorded (a server that restarted), or None. Asked by
        `status`, so it never waits (a server's adapter answers what its last look found); an engine in this process
        is never gone."""

    lora_rank: int | None
    """The engine's `max_lora_rank`; None: it serves no LoRA adapters (`stage_adapter` refuses)."""

    worker_calls_beside_requests: bool
    """Whether its workers may be called while it generates (an `AsyncLLM`'s calls queue between engine steps); if
    not, installing or unloading an adapter waits for the requests in flight and holds new ones meanwhile."""


@dataclass(frozen=True, slots=True)
class Serving:
    """What one request runs on, fixed when it is admitted: the weights' version and the adapter, if any.

    `ReplicaCore.request()` yields it; pass `adapter.lora_request()` to vLLM's `generate` when `adapter` is set.
    """

    version: int | None  # None: the weights the engine started with
    adapter: ServedAdapter | None


class ReplicaCore:
    def __init__(self, engine: EngineAdapter) -> None:
        self.engine = engine
        self.facts = engine.facts
        self.workers = WorkerCalls(engine.call_workers)
        self.lifecycle = UpdateLifecycle(refusal=self.facts.initial_refusal)
        self._lock = threading.Lock()  # update steps vs the watchdog
        # A user's actor with max_concurrency > 1 may start two of a sync's load_bucket calls in either order, and a
        # transport that reads ahead must take its buckets in the order they were sent (`_await_turn`).
        self._turn = threading.Condition(self._lock)
        self._next_bucket = 0  # of the open update: the index of the bucket whose turn it is
        self._open: tuple[TransferPlan, SyncConfig] | None = None  # of the update the lifecycle holds open
        self._progress = {"buckets": 0, "load_seconds": 0.0}  # of the open (or last) update
        self._last_update: dict | None = None  # what `refit inspect` shows
        self._group_id: str | None = None  # the collective group the workers joined
        # Delta syncs (refit/transport/delta.py): the base lives where buckets become tensors, here
        # over `ray`, in each worker over `collective`; `_digest` names the version it holds, and where.
        self._base = ReplicaBase()
        self._digest: tuple[str, str] | None = None  # (transport, digest) of the served version's base
        self._workers_keep_base = False
        self._acceptance: float | None = None  # the draft's, measured after the last sync
        self.adapters = AdapterSlots()  # the LoRA adapter served, retiring and staged (refit/adapters/serving.py)
        self._closed = threading.Event()
        threading.Thread(target=self._watch_leases, name="refit-lease-watchdog", daemon=True).start()

    # -- observation (never waits for an update or a request) ---------------------
    def describe(self) -> RolloutModelInfo:
        return self.facts.model_info

    def status(self) -> ReplicaStatus:
        status = replace(self.lifecycle.status(), adapter=self.adapters.serving)
        if status.phase is Phase.SERVING and (gone := self.engine.gone()) is not None:
            # Between syncs nothing else would tell: a restarted server serves what it started with, not this version.
            return replace(status, phase=Phase.REFUSING, reason=gone)
        return status

    def transport_ranks(self) -> int:
        """How many ranks this replica takes in a collective group: one per vLLM worker."""
        return self.facts.workers

    def transports(self) -> dict:
        """The transports `transport="auto"` may pick that this replica's engine takes, where its workers run, and the
        host (its local workers' too)."""
        accepts = [name for name in AUTO_CANDIDATES if self.engine.transport_refusal(transport_kind(name)) is None]
        return {"accepts": accepts, "device": self.facts.device, "host": host_identity()}

    def transport_group(self) -> str | None:
        """The collective group this replica's workers are in, if any."""
        return self._group_id

    def last_update(self) -> dict | None:
        """The last update's outcome as plain data: sync id, version, buckets, seconds, scales written, digest."""
        return self._last_update

    def base_digest(self, transport: str) -> str | None:
        """The digest of the version this replica serves, if it holds that version's bytes as a delta base for
        `transport` (a sync over it may then send only what changed); None: the next sync must be full."""
        if self._digest is None or self._digest[0] != str(transport):
            return None
        return self._digest[1]

    # -- serving ------------------------------------------------------------------------
    @contextmanager
    def request(self, *, allow_refusing: bool = False) -> Iterator[Serving]:
        """Run a request on a whole model: waits out an update, refuses while refusing (see `UpdateLifecycle.request`);
        yields the version and adapter it runs on (the adapter stays loaded until the request ends)."""
        with self.lifecycle.request(allow_refusing=allow_refusing), self.adapters.using() as adapter:
            yield Serving(self.lifecycle.status().served_version, adapter)

    def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing: that is when it matters most)."""
        with self.lifecycle.request(allow_refusing=True):
            return self.workers.scale_records()

    # -- the collective group -----------------------------------------------------------
    def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        """Every worker joins a sync's collective group as members from `member_offset` on (leaving any earlier group).

        During an update only the sync that owns it (`sync_id`) may move the workers to another group.
        """
        with self._lock:
            self.lifecycle.check_group_change(sync_id)
            self._group_id = None
            self.workers.join_group(rendezvous, member_offset)
            self._group_id = rendezvous.group_id

    def leave_transport(self, group_id: str | None = None) -> None:
        """Take the workers out of `group_id` (None: the group this replica joined them to, or any if none).

        The workers check the id too: a server's workers outlive the replica that joined them to a group, and one
        that took the server over may have joined them to its own since."""
        with self._lock:
            if group_id is not None and self._group_id not in (None, group_id):
                return  # in another sync's group, which may be streaming
            group_id, self._group_id = group_id or self._group_id, None
            self.workers.leave_group(group_id)

    # -- the update lifecycle ---------------------------------------------------------------
    def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        """Hold new requests, pause (requests in flight finish or abort), start the reload; returns the lowest version accepted."""
        if config.kv_scales is KvScalePolicy.RECOMPUTE:  # bad ids or lengths would fail only after every weight is loaded
            token_prompts(config.calibration_prompts, vocab_size=self.facts.vocab_size, setting="calibration_prompts",
                          max_model_len=self.facts.max_model_len)
        if (refusal := self.engine.transport_refusal(config.transport_kind)) is not None:  # before requests are held
            raise ConfigError(refusal)
        if config.verify is Verify.PROBE and self.facts.model_info.serves_lora and self.facts.device == "cpu":
            # vLLM's CPU LoRA kernels map the logits by request, not by token, and fail on prompt logprobs: the probe
            # would fail after every weight loaded and leave the replica refusing. Asked of the engine's facts, not of
            # `lora_rank`: a server with LoRA on installs no adapter of refit's, and applies LoRA all the same.
            raise ConfigError("verify='probe' on a CPU replica with LoRA on (EngineConfig.lora_rank, vLLM's "
                              "--enable-lora): vLLM's CPU LoRA path cannot score prompt logprobs (add_lora_logits "
                              "fails); sync with verify='checksums'")
        self.engine.check(config)
        with self._lock:
            holds = self.lifecycle.open_update() is None  # a rival sync's update keeps its own hold; begin refuses it
            if holds:
                self.engine.hold_requests(config.timeout_s)
            try:
                version = self.lifecycle.begin(sync_id, lease_s=config.update_lease_s, drain_timeout_s=config.timeout_s)
            except BaseException:
                if holds:
                    self.engine.release_requests()
                raise
            self._progress = {"buckets": 0, "load_seconds": 0.0, "bytes_received": 0}
            self._next_bucket = 0
            try:
                self.engine.pause(config.pause, config.timeout_s)
                self._begin_base(config)
                self.workers.start_update(plan, config.transport, keep_base=config.keeps_delta_base)
            except BaseException as error:
                self._close(sync_id, f"starting the update failed: {error!r}")
                raise
            self._open = (plan, config)
            return version

    def load_bucket(
        self, sync_id: str, version: int, bucket: WireBucket | list[WireBucket | Any | BucketContents],
        next_bucket_bytes: list[int | None] | None = None,
    ) -> float:
        """Load one bucket (one part per sending rank of a sharded trainer); returns seconds spent loading.

        How it comes is its transport's (`TransportKind.deliver`): through
        Ray's object store the parts come as refs, fetched here; over
        `collective` or `ipc` as their contents, while the workers receive
        the bytes (`next_bucket_bytes`: each rank's next part's size, for the
        workers to post its receive early).
        """
        with self._lock:
            self.lifecycle.renew(sync_id, "load_bucket")
            plan, config = self._open
            self._digest = None  # the base changes from here until the update is served
            index: int | None = None  # where the order matters: this bucket's, once it is its turn
            try:
                if config.transport_kind.traits.reads_ahead:
                    index = self._await_turn(sync_id, bucket, config.timeout_s)
                seconds = config.transport_kind.deliver(bucket, next_bucket_bytes, _BucketLoad(self, sync_id, version, plan, config),
                                                        config.timeout_s)
            except BaseException as error:
                refused = isinstance(error, (VerificationError, InvalidTensorError, PlanMismatchError))
                self._close(sync_id, f"loading a bucket failed: {error}", model_changed=self._loaded_anything() if refused else None)
                raise
            finally:
                if index is not None and self.lifecycle.open_update() == sync_id:
                    self._next_bucket = max(self._next_bucket, index + 1)
                    self._turn.notify_all()
            self._progress["buckets"] += 1
            self._progress["load_seconds"] += seconds
            return seconds

    def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        """Verify, finalize, resume, run the post-refit stage (and the probe) with requests still held, serve `version`.

        A failed check raises, and the replica has closed the update and refuses.
        """
        with self._lock:
            self.lifecycle.finishing(sync_id, version)
            start = time.perf_counter()
            plan, config = self._open
            outcome, probe_passed, stage = "off", None, "finishing the reload"
            try:
                if config.verify is not Verify.OFF:
                    received = self.workers.streamed()
                    refuse_partial(plan, received)
                self.workers.finish_update()  # refuses an incomplete update, or scales the engine holds wrongly
                if config.verify is not Verify.OFF:
                    outcome = f"integrity tags, {len(received)} tensors complete, scales read back"
                self.engine.resume()  # the stage may generate; users' requests are still held
                stage = "the post-refit KV-scale stage"
                written = self._apply_kv_scales(config.kv_scales, config.calibration_prompts, version)
                acceptance = None
                if self.facts.model_info.draft is not None and config.verify is not Verify.OFF:
                    stage = "measuring the draft's acceptance"
                    acceptance, collapsed = self._draft_acceptance()
                    if collapsed:
                        outcome, probe_passed = f"{outcome}; {collapsed}", False
                        if config.on_probe_breach == "fail":
                            raise VerificationError(f"after the refit {collapsed}")
                if probe is not None:
                    stage = "the logprob probe"
                    result = self._probe(probe)
                    outcome, probe_passed = f"{outcome}; {result}", result.passed
                    if not result.passed and probe.fail:
                        raise VerificationError(f"the logprob probe after the refit failed: {result}")
                stage = "setting the engine's weight version"
                self.engine.mark_version(version)
                digest = self._finish_base(config)
                # Part of the update: a server whose gate never heard the release keeps its users held until the
                # hold lapses into a refusal, so a replica that said it serves would be wrong. (Requests through
                # the core itself wait for the lifecycle's word, which comes next.)
                stage = "releasing the requests held for the update"
                self.engine.release_requests()
            except BaseException as error:
                # After the reload is finalized the model has changed, whatever the bucket count says.
                self._close(sync_id, f"{stage} failed: {error}", model_changed=stage != "finishing the reload" or None)
                raise
            self._open = None
            if acceptance is not None:  # the next sync's baseline: what a served version measured, not a refused one
                self._acceptance = acceptance
            self.lifecycle.finished(sync_id, version)
            seconds = time.perf_counter() - start
            self._record(sync_id, version, "served", finish_seconds=seconds, kv_scales_written=written, verification=outcome,
                         digest=digest, draft_acceptance=acceptance)
            return FinishedUpdate(seconds, tuple(written), outcome, probe_passed, self._progress["bytes_received"], digest,
                                  acceptance)

    def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        """Close `sync_id`'s update if it is open; returns the status that leaves."""
        with self._lock:
            return self._close(sync_id, reason)

    def close(self) -> None:
        """Stop the lease watchdog (the replica is going away)."""
        self._closed.set()

    def drop_delta_base(self) -> None:
        """Free the copy of the served version kept for delta syncs; the next sync sends this replica everything."""
        with self._lock:
            if self.lifecycle.open_update() is not None:
                raise LifecycleError(f"drop_delta_base() during update {self.lifecycle.open_update()}; call it between syncs")
            self._digest = None
            self._base.clear()
            if self._workers_keep_base:
                self.workers.drop_base()
                self._workers_keep_base = False

    # -- LoRA adapters (refit/adapters/): staged on every replica, then served; the base is never touched ----------
    def stage_adapter(self, sync_id: str, version: int, adapter: AdapterWeights, timeout_s: float) -> str:
        """Install `adapter` as `version` beside the one served, serving it to no one yet; returns the digest of the
        bytes its workers built it from. First unloads the adapter retired by the last swap, waiting up to `timeout_s`
        for its last requests. A failure leaves the served adapter serving, and nothing new installed."""
        if self.engine.lora_rank is None:
            raise ConfigError(
                "this replica's engine serves no LoRA adapters: start it with EngineConfig(lora_rank=...) (a `vllm serve` "
                "replica cannot take adapters from memory, docs/lora.md)"
            )
        check_adapter(adapter.meta(digest=False), self.facts.model_info.weights, self.engine.lora_rank)
        with self._lock:
            if self.lifecycle.open_update() is not None:
                raise LifecycleError(f"stage_adapter during sync {self.lifecycle.open_update()}'s update; run it after")
            staged, abandoned = self.adapters.stage(sync_id, adapter.name, version, stale_after_s=max(timeout_s, 1.0))
            try:
                with self._worker_calls(timeout_s):
                    for old in (abandoned, self.adapters.retired(timeout_s)):
                        if old is not None:
                            self.workers.remove_adapter(old.lora_id)
                    digests = set(self.workers.add_adapter(staged.lora_id, adapter))
            except BaseException:
                self.adapters.unstage(sync_id, version)
                self._unload_quietly(staged, timeout_s)
                raise
            if len(digests) != 1:
                self.adapters.unstage(sync_id, version)
                self._unload_quietly(staged, timeout_s)
                raise VerificationError(f"adapter {staged}: the engine's workers hold different bytes ({sorted(digests)})")
            return digests.pop()

    def serve_adapter(self, sync_id: str, version: int) -> dict[str, Any]:
        """New requests run on the staged `version` from now on; requests running finish on the one it replaces,
        unloaded now if none runs, else by the next `stage_adapter`. Returns what was swapped, as plain data."""
        with self._lock:
            served = self.adapters.serve(sync_id, version)
            retired, unloaded = self.adapters.retiring, None
            if retired is not None and self.adapters.retired(None) is not None:
                self._unload_quietly(retired, timeout_s=None)
                unloaded = str(retired)
            return {"serving": str(served), "retired": None if retired is None else str(retired), "unloaded": unloaded}

    def unstage_adapter(self, sync_id: str, version: int) -> None:
        """Drop `sync_id`'s staged `version` (the fleet's adapter sync failed elsewhere); the served one stays."""
        with self._lock:
            staged = self.adapters.unstage(sync_id, version)
            if staged is not None:
                self._unload_quietly(staged, timeout_s=None)

    @contextmanager
    def _worker_calls(self, timeout_s: float) -> Iterator[None]:
        """Where the workers may be called beside requests: here. Elsewhere with no request running (bounded)."""
        if self.engine.worker_calls_beside_requests:
            yield
        else:
            with self.lifecycle.quiesced(timeout_s):
                yield

    def _unload_quietly(self, adapter: ServedAdapter, timeout_s: float | None) -> None:
        """Unload an adapter no request can name any more; a failure leaves it loaded (memory, not correctness)."""
        try:
            with self._worker_calls(timeout_s if timeout_s is not None else _UNLOAD_WAIT_S):
                self.workers.remove_adapter(adapter.lora_id)
        except Exception as error:  # noqa: BLE001 - the swap itself has succeeded or failed already
            log.warning("could not unload adapter %s: %r", adapter, error)

    # -- the steps' parts -----------------------------------------------------------------
    def _begin_base(self, config: SyncConfig) -> None:
        """Keep the base this update's transport uses (its digest still names it: the driver asks after begin), drop the other."""
        base_in = config.transport_kind.traits.delta_base_in
        if config.keeps_delta_base and base_in == "replica":
            self._base.begin()
        else:
            self._base.clear()
        if not (config.keeps_delta_base and self._digest is not None and self._digest[0] == str(config.transport)):
            self._digest = None
        if self._workers_keep_base and base_in != "workers":
            self.workers.drop_base()  # their base is for another transport: no second copy of the model
        self._workers_keep_base = config.keeps_delta_base and base_in == "workers"

    def _finish_base(self, config: SyncConfig) -> str | None:
        """The served version's digest, when a base holds it (over `collective`: every worker's must agree)."""
        if not config.keeps_delta_base:
            return None
        if config.transport_kind.traits.delta_base_in == "replica":
            digest = self._base.finish()
        else:
            digests = set(self.workers.base_digests())
            digest = digests.pop() if len(digests) == 1 else None
        self._digest = None if digest is None else (str(config.transport), digest)
        return digest

    def _apply_kv_scales(self, policy: KvScalePolicy, calibration_prompts: Sequence[Sequence[int]], version: int) -> list[str]:
        """The post-refit stage; returns the attention scales written ("module.scale")."""
        measured, made_valid = None, []
        if policy is KvScalePolicy.RECOMPUTE:
            # The calibration pass itself runs through an FP8 KV cache, which
            # refuses dummy scales: make placeholders valid (1.0) first.
            made_valid = self.workers.apply_kv_policy(KvScalePolicy.AUTO, version, None)
            # The prefix cache holds K/V the old weights made: a cached prompt's blocks would be skipped, unmeasured.
            self.engine.reset_prefix_cache()
            self.workers.start_amax()
            try:
                self.engine.generate(calibration_prompts, 1)
            except BaseException:
                # Take the hooks out (stop also says no layer was seen): left in, every later forward pass of the
                # engine would measure every attention layer, a device sync each.
                with contextlib.suppress(Exception):
                    self.workers.stop_amax()
                raise
            measured = self.workers.stop_amax()
        written = self.workers.apply_kv_policy(policy, version, measured)
        self.engine.reset_prefix_cache()
        # Both writes are this version's: a scale only reset (prob_scale, which nothing measures) is a write too.
        return list(dict.fromkeys([*made_valid, *written]))

    def _draft_acceptance(self) -> tuple[float | None, str | None]:
        """The draft model's accepted share of its proposals on the probe prompts, and why it collapsed if it did
        (below half of what the last served sync measured: a draft left behind its target, or broken by the sync).

        None where the engine does not count speculative tokens (`EngineAdapter.spec_decode_counts`).
        """
        before = self.engine.spec_decode_counts()
        if before is None:
            return None, None
        self.engine.generate(probe_prompts(self.facts.vocab_size), DRAFT_PROBE_TOKENS)
        drafted, accepted = (a - b for a, b in zip(self.engine.spec_decode_counts(), before))
        if drafted <= 0:
            return None, None
        acceptance, previous = accepted / drafted, self._acceptance
        if previous is not None and acceptance < previous / 2:
            return acceptance, f"the draft model's acceptance fell to {acceptance:.0%} from {previous:.0%}"
        return acceptance, None

    def _probe(self, request: ProbeRequest) -> ProbeResult:
        """Score the probe prompts and compare with the trainer's logprobs, at this engine's precision's thresholds."""
        scored = self.engine.generate([list(p) for p in request.prompts], 1, prompt_logprobs=True)
        thresholds = thresholds_for(self.facts.model_info.quantization_config is not None, self.facts.fp8_kv_cache)
        return compare([row[1:] for row in scored.prompt_logprobs], request.reference, thresholds)

    def _await_turn(self, sync_id: str, bucket: list[BucketContents], timeout_s: float) -> int:
        """Wait, within `timeout_s`, until every bucket before this one is loaded; returns its index. The caller holds
        the lock.

        Why: over a transport that reads ahead each worker posts its receives
        in bucket order, to meet the trainer's broadcasts in the order they
        were sent; a bucket taken out of turn receives another's bytes (a
        refused tag, or an aborted process where sizes differ).
        """
        index = min(part.index for part in bucket)
        if not self._turn.wait_for(lambda: index <= self._next_bucket or self.lifecycle.open_update() != sync_id,
                                   timeout=timeout_s):
            raise SyncTimeoutError(f"bucket {index} arrived, but bucket {self._next_bucket} before it was not loaded within "
                                   f"{timeout_s:.0f} s (SyncConfig.timeout_s)")
        self.lifecycle.renew(sync_id, "load_bucket")  # the update may have closed while this call waited
        return index

    def _close(self, sync_id: str, reason: str, *, model_changed: bool | None = None) -> ReplicaStatus:
        """Close `sync_id`'s update after a failure (a no-op unless it is the open one); the caller holds the lock."""
        if self.lifecycle.open_update() != sync_id:
            return self.lifecycle.status()
        self._turn.notify_all()  # loads waiting for their turn (`_await_turn`) find the update closed
        self._open = None
        self._digest = None
        self._base.abort()  # the workers' base: their `abandon_update`
        try:
            self.workers.abandon_update()
        except BaseException as error:  # layers may be left in loadable form: never serve them
            reason, model_changed = f"{reason}; closing the reload failed too: {error!r}", True
        try:
            self.engine.resume()
        except BaseException as error:
            reason, model_changed = f"{reason}; resuming the engine's scheduler failed: {error!r}", True
        status = self.lifecycle.failed(sync_id, reason, model_changed=model_changed)
        self._record(sync_id, None, f"failed: {reason}")
        try:
            self.engine.release_requests(status.reason if status.phase is Phase.REFUSING else None)  # run, or refused
        except Exception as error:  # noqa: BLE001 - the caller's failure is the one to raise, not this echo of it
            # A server that cannot be reached keeps its gate shut until an update's release reaches it.
            log.error("replica: releasing the requests held by sync %s failed: %r", sync_id, error)
        return status

    def _loaded_anything(self) -> bool | None:
        """Whether the open update handed the engine any tensor; None if its workers cannot say (the bucket count decides).

        Why ask: a bucket refused before loading (an integrity tag, a name,
        dtype, shape or scale the plan does not allow) leaves the model as it
        was, so a replica that loaded nothing else keeps serving its version.
        Asked only after such a refusal: a hung or dead engine would make the
        question wait out another deadline.
        """
        try:
            return bool(self.workers.streamed())
        except Exception:  # noqa: BLE001 - a worker that cannot answer: assume the worst
            return None

    def _record(self, sync_id: str, version: int | None, outcome: str, **extra: Any) -> None:
        self._last_update = {
            "sync_id": sync_id, "version": version, "outcome": outcome, "at": time.time(), **self._progress, **extra,
        }

    def _watch_leases(self) -> None:
        """Close an update whose sync stopped calling. Runs for the replica's life: a failure closing one update is
        logged, never the end of the watch, or every later update whose driver died would stay open."""
        while not self._closed.wait(_WATCHDOG_PERIOD_S):
            if self.lifecycle.expired() is None:
                continue
            try:
                with self._lock:
                    expired = self.lifecycle.expired()  # a call may have renewed it meanwhile
                    if expired is not None:
                        self._close(expired, f"sync {expired} stopped calling (its driver died or was interrupted)")
            except Exception:  # noqa: BLE001
                log.exception("replica: closing an update whose lease lapsed failed")


@dataclass
class _BucketLoad:
    """One bucket's load into `core`'s open update: the `BucketSink` its transport's `deliver` calls, one way or the other."""

    core: ReplicaCore
    sync_id: str
    version: int
    plan: TransferPlan
    config: SyncConfig

    def load_fetched(self, parts: list[WireBucket]) -> float:
        """Parts fetched from the object store: made tensors here (rebuilding deltas on the base), handed to the workers."""
        core, verify = self.core, self.config.verify is not Verify.OFF
        core._progress["bytes_received"] += sum(part.nbytes for part in parts)
        tensors = loadable_tensors(self.plan, parts, verify=verify, base=core._base if self.config.keeps_delta_base else None)
        core.lifecycle.loading(self.sync_id, self.version)
        start = time.perf_counter()
        core.workers.load(tensors, self.version, verify=verify)
        return time.perf_counter() - start

    def receive_in_workers(self, contents: list[BucketContents], next_bucket_bytes: list[int | None]) -> float:
        """Only the contents cross the RPC; the workers receive the bytes (each rank's next part's size: post it early)."""
        core = self.core
        core.lifecycle.loading(self.sync_id, self.version)
        start = time.perf_counter()
        core._progress["bytes_received"] += sum(part.nbytes for part in contents)
        core.workers.receive(contents, next_bucket_bytes, self.version, verify=self.config.verify is not Verify.OFF)
        return time.perf_counter() - start


def delegate_to_replica(
    *, groups: Collection[ConcurrencyGroup] | None = None, coroutines: bool = False, ray_groups: bool = False
) -> Callable[[type[_C]], type[_C]]:
    """A class decorator: every replica method of `refit.protocols.REPLICA_METHODS` (those in `groups`, if given) that
    the class does not have yet, as a call to the same method of `self.replica`.

    Each takes the protocol method's signature and docstring (Ray reads the signature to check a call's
    arguments, `refit.protocols.accepts` to find optional ones). `coroutines`: each one made is `async` and
    awaits the replica's (an `AsyncReplica`, whose update steps and `scale_records` are coroutines).
    `ray_groups`: each one runs in its declared Ray concurrency group (`ray.method(concurrency_group=...)`).
    """

    def decorate(cls: type[_C]) -> type[_C]:
        for name, spec in REPLICA_METHODS.items():
            if hasattr(cls, name) or (groups is not None and spec.group not in groups):
                continue
            method = _delegation(cls, name, coroutines)
            if ray_groups:
                import ray

                method = ray.method(concurrency_group=spec.group)(method)
            setattr(cls, name, method)
        return cls

    return decorate


def _delegation(cls: type, name: str, coroutine: bool) -> Callable[..., Any]:
    """`self.replica.<name>(...)` as a method of `cls`, with the protocol's signature and docstring."""
    if coroutine:
        async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.replica, name)(*args, **kwargs)
    else:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.replica, name)(*args, **kwargs)
    return as_declared(method, cls, name, getattr(FullRolloutReplica, name))


@delegate_to_replica(groups={"observe"})
class ReplicaObservation:
    """The observation methods of a replica (none waits), handed to `self.replica`; both mixins below take them.

    `node_id` is the actor's own (where it runs); the others are made from `refit.protocols.REPLICA_METHODS`.
    """

    replica: Any

    def node_id(self) -> str:
        """The Ray node the replica runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


@delegate_to_replica()
class ReplicaMethods(ReplicaObservation):
    """The methods `refit.Syncer` calls (`refit.protocols.FullRolloutReplica`, every one), handed to `self.replica`.

    Mix into a rollout actor that holds its own engine: set
    `self.replica = refit.llm_replica(llm)` in its constructor and run its
    requests inside `self.replica.request()` (examples/own_engine.py). The
    methods are made from `refit.protocols.REPLICA_METHODS` (`delegate_to_replica`).
    """

    replica: ReplicaCore
