"""`Syncer`: put a trainer's current weights into every rollout replica.

The whole flow of one sync, top to bottom:

1. plan (once, reused): trainer metadata + rollout model info ->
   `TransferPlan` (names, FP8_BLOCK decisions, tied alias, buckets);
2. every replica begins an update: it waits for in-flight requests, holds
   new ones, starts a layerwise reload, and proposes the lowest version it
   accepts; the sync's version is the highest proposal, so a version number
   never names two different sets of weights;
3. the trainer streams buckets (Ray streaming generator: each bucket is put
   once in the object store, and the trainer runs at most
   `max_buckets_in_flight` ahead); each bucket is handed to every replica as
   soon as it exists, so quantizing bucket i+1 overlaps loading bucket i;
4. every replica checks that every weight was loaded, finalizes the reload,
   runs the post-refit KV-scale stage, clears its prefix cache and serves
   the new version.

How the bytes travel is `SyncConfig.transport` (refit/transport/): through
Ray's object store (`ray`: each replica fetches the bucket's refs itself, so
the driver never pulls bucket bytes), or over a collective group the Syncer
makes once (`collective`) or CUDA IPC (`ipc`), where the trainer's stream
carries only each bucket's table of contents and the driver hands it on to
the replicas together with the next bucket's size.

Before its first remote call a Syncer waits for actors still being
constructed (`SyncConfig.startup_timeout_s`); from then on every remote wait
has a deadline (`SyncConfig.timeout_s`). On any failure, at any step,
including a driver interrupt, the trainer's stream is closed and every
replica's update is aborted: a replica that received nothing keeps serving
its old version, one that did refuses to serve until a later sync completes.
The error raised is the cause: when a member died, its death, whichever of
its echoes (a broken group, a lost object, a missed deadline) arrived first;
the echoes and each replica's resulting state are attached as notes.
"""

from __future__ import annotations

import collections
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from refit.engine.lifecycle import FinishedUpdate
from refit.errors import ActorDiedError, ConfigError, EngineError, PlanMismatchError, VerificationError
from refit.orchestration.calls import (
    BucketStream,
    call_all,
    dead_members,
    is_actor,
    raise_first_error,
    submit_all,
    summary,
    wait_all,
    wait_until_started,
)
from refit.orchestration.metrics import record_failure, record_sync
from refit.orchestration.report import ReplicaReport, SyncReport
from refit.plan.config import SyncConfig, Transport, Verify
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan, make_plan
from refit.protocols import RolloutReplica, WeightSource, has_method, missing_methods
from refit.transport.collective import Rendezvous, RendezvousHost
from refit.transport.ipc import IpcTransport
from refit.verification.probe import ProbeRequest, probe_prompts

__all__ = ["Syncer", "sync"]

log = logging.getLogger("refit.orchestration")


class Syncer:
    """Repeated syncs from one weight source to a fixed set of rollout replicas.

    `trainer` and `rollouts` are Ray actor handles (or plain objects)
    implementing `WeightSource` and `RolloutReplica`. A sharded trainer is
    any object whose `ranks` are weight sources (`ShardedWeightSource`, e.g.
    `actors.TrainerGroup`): every rank streams its part of each bucket, and
    each replica fetches the parts straight from the ranks.
    """

    def __init__(
        self, trainer: WeightSource, rollouts: RolloutReplica | Sequence[RolloutReplica], config: SyncConfig | None = None
    ) -> None:
        self.trainer = trainer
        self.rollouts = list(rollouts) if isinstance(rollouts, (list, tuple)) else [rollouts]
        if not self.rollouts:
            raise ConfigError("Syncer needs at least one rollout replica")
        if config is not None and not isinstance(config, SyncConfig):
            raise ConfigError(f"config={config!r}: expected a refit.SyncConfig")
        _refuse_actor_classes([("trainer", trainer)] + [(f"rollout {i}", r) for i, r in enumerate(self.rollouts)])
        self._sources = _weight_sources(trainer)
        problems = [f"{who} lacks {m}()" for who, source in self._sources for m in missing_methods(source, WeightSource)]
        for i, replica in enumerate(self.rollouts):
            problems += [f"rollout {i} lacks {m}()" for m in missing_methods(replica, RolloutReplica)]
        self.config = config or SyncConfig()
        if self.config.verify is Verify.PROBE:
            problems += [f"{who} lacks reference_logprobs(), which verify='probe' needs"
                         for who, source in self._sources if not has_method(source, "reference_logprobs")]
        problems += self._transport_problems()
        if problems:
            raise ConfigError("these actors cannot be synced (see refit.protocols):\n  " + "\n  ".join(problems))
        self._replicas = [(f"rollout {i}", r) for i, r in enumerate(self.rollouts)]
        self._plan: TransferPlan | None = None
        self._rollout_model: RolloutModelInfo | None = None
        self._group: RendezvousHost | None = None  # the collective group's rendezvous, held while the group lives
        self._started = False  # every actor has finished its constructor (awaited once)

    def _transport_problems(self) -> list[str]:
        transport = self.config.transport
        if transport is not Transport.COLLECTIVE:
            return []
        needs = ("join_transport", "leave_transport", "transport_group")
        problems = [f"{who} lacks {m}(), which transport='collective' needs"
                    for who, source in self._sources for m in needs if not has_method(source, m)]
        problems += [f"rollout {i} lacks {m}(), which transport='collective' needs"
                     for i, r in enumerate(self.rollouts) for m in (*needs, "transport_ranks") if not has_method(r, m)]
        return problems

    def wait_until_started(self) -> float:
        """Wait for trainer ranks and replicas still being constructed (`SyncConfig.startup_timeout_s`); seconds waited.

        Once per Syncer, before its first remote call; `plan()` and `sync()`
        call it, and an RL loop may call it early to time its engines' start.
        """
        if self._started:
            return 0.0
        with _progress_bar(self.config.progress, len(self._sources) + len(self._replicas), "refit: actors started") as bar:
            seconds = wait_until_started(self._sources + self._replicas, timeout_s=self.config.startup_timeout_s,
                                         on_started=bar.update)
        self._started = True
        if seconds > 1.0:
            log.info("every trainer rank and replica started (waited %.1f s)", seconds)
        return seconds

    def plan(self) -> TransferPlan:
        """The transfer plan, made on first use from both sides' metadata."""
        self.wait_until_started()
        if self._plan is None:
            timeout = self.config.timeout_s
            infos = raise_first_error(call_all(self._replicas, "describe", timeout_s=timeout))
            _check_same_model(infos)
            metadata = raise_first_error(call_all(self._sources, "weight_metadata", timeout_s=timeout))
            self._plan = make_plan(_merge_metadata(self._sources, metadata), infos[0], self.config)
            self._rollout_model = infos[0]
        return self._plan

    def sync(self) -> SyncReport:
        """Put the trainer's current weights into every replica; see the module docstring."""
        startup_seconds = self.wait_until_started()
        start = time.perf_counter()
        planned_before = self._plan is not None
        plan = self.plan()
        plan_seconds = 0.0 if planned_before else time.perf_counter() - start
        sync_id = uuid.uuid4().hex[:12]
        timeout = self.config.timeout_s

        stages: dict[str, float] = {}
        try:
            stage = time.perf_counter()
            proposals = raise_first_error(call_all(self._replicas, "begin_update", plan, sync_id, self.config, timeout_s=timeout))
            version = max(proposals)
            # After begin: a rival sync refused by the replicas never gets to take the trainer into its group.
            transport = self._connect(sync_id)
            stages["begin"], stage = time.perf_counter() - stage, time.perf_counter()
            log.debug("sync %s v%d: began on %d replica(s)", sync_id, version, len(self.rollouts))
            load_seconds = self._stream(plan, sync_id, version, transport)
            stages["stream"], stage = time.perf_counter() - stage, time.perf_counter()
            log.debug("sync %s v%d: streamed %d bucket(s), %.1f MiB per replica, in %.3f s",
                     sync_id, version, len(plan.buckets), plan.wire_bytes / 2**20, time.perf_counter() - start)
            probe = () if self.config.verify is not Verify.PROBE else (self._probe_request(),)
            finished = raise_first_error(call_all(self._replicas, "finish_update", sync_id, version, *probe, timeout_s=timeout))
            stages["finish"] = time.perf_counter() - stage
        except BaseException as error:
            cause = self._failed(sync_id, error)
            if cause is error:
                raise
            raise cause from None
        log.info("sync %s v%d: every replica serves it (%.3f s)", sync_id, version, time.perf_counter() - start)

        nodes = raise_first_error(call_all(self._replicas, "node_id", timeout_s=timeout))
        wrong = [f"rollout {i}: {f!r}" for i, f in enumerate(finished) if not isinstance(f, FinishedUpdate)]
        if wrong:
            raise EngineError("finish_update must return a refit.engine.lifecycle.FinishedUpdate:\n  " + "\n  ".join(wrong))
        report = SyncReport(
            version=version,
            tensors=len(plan.tensors),
            buckets=len(plan.buckets),
            bytes_on_wire=plan.wire_bytes,
            plan_seconds=plan_seconds,
            trainer_seconds=self._trainer_seconds(),
            total_seconds=time.perf_counter() - start,
            replicas=tuple(
                ReplicaReport(i, nodes[i], version, load_seconds[i], f.seconds, f.kv_scales_written, f.verification)
                for i, f in enumerate(finished)
            ),
            begin_seconds=stages["begin"],
            stream_seconds=stages["stream"],
            finish_seconds=stages["finish"],
            probe_breached=any(f.probe_passed is False for f in finished),
            startup_seconds=startup_seconds,
        )
        if report.probe_breached:
            log.warning("sync %s v%d: the logprob probe breached its thresholds (flagged, not failed)", sync_id, version)
        record_sync(report, verified=self.config.verify is not Verify.OFF)
        return report

    def _stream(self, plan: TransferPlan, sync_id: str, version: int, transport: Rendezvous | IpcTransport | str) -> list[float]:
        """Hand each bucket to every replica as it is produced; bounded in flight, every wait bounded.

        Over `collective` and `ipc` the driver reads each bucket's contents
        and looks one bucket ahead, so that a worker can post the receive of
        the next bucket before it loads this one.
        """
        timeout = self.config.timeout_s
        in_flight: collections.deque[list[tuple[str, Any]]] = collections.deque()
        seconds = [0.0] * len(self.rollouts)

        def wait_oldest() -> None:
            spent = raise_first_error(wait_all(in_flight.popleft(), "load_bucket", timeout_s=timeout))
            for replica, value in enumerate(spent):
                seconds[replica] += value
            progress.update()

        def ended_early(parts: list[Any]) -> PlanMismatchError:
            while in_flight:  # a trainer that failed ended its stream: the loads raise its error first
                wait_oldest()
            ended = [who for (who, _), part in zip(self._sources, parts) if part is None]
            return PlanMismatchError(f"{', '.join(ended)} ended the stream before the plan's {len(plan.buckets)} buckets")

        by_contents = transport != Transport.RAY
        streams = [BucketStream(source, plan, self.config.max_buckets_in_flight, transport, who=who) for who, source in self._sources]
        progress = _progress_bar(self.config.progress, len(plan.buckets), f"refit sync v{version}", unit="bucket")
        try:
            upcoming = [stream.next(timeout, fetch=True) for stream in streams] if by_contents else []
            for index in range(len(plan.buckets)):
                if by_contents:  # each rank's contents of this bucket, and of the one after
                    parts = upcoming
                    upcoming = [stream.next(timeout, fetch=True) for stream in streams] if index + 1 < len(plan.buckets) else []
                else:
                    parts = [stream.next(timeout) for stream in streams]  # one part per rank (one rank: the bucket)
                if any(part is None for part in parts):
                    raise ended_early(parts)
                if by_contents:
                    args = (parts, [None if part is None else part.nbytes for part in upcoming or [None] * len(parts)])
                else:
                    args = (parts[0] if len(parts) == 1 else [ref for part in parts for ref in _as_list(part)],)
                in_flight.append(submit_all(self._replicas, "load_bucket", sync_id, version, *args))
                while len(in_flight) >= self.config.max_buckets_in_flight:
                    wait_oldest()
            while in_flight:
                wait_oldest()
            extra = [who for (who, _), stream in zip(self._sources, streams) if stream.next(timeout) is not None]
            if extra:
                raise PlanMismatchError(f"{', '.join(extra)} streamed more buckets than the plan's {len(plan.buckets)}")
        finally:
            progress.close()
            for stream in streams:
                stream.close()
        return seconds

    # -- the collective group ---------------------------------------------------
    def _connect(self, sync_id: str) -> Rendezvous | IpcTransport | str:
        """What the trainer's stream is told to send over: "ray", an `IpcTransport`, or the collective group's rendezvous.

        The group (the sending trainer ranks, then every worker of every
        replica; a channel per sending rank) is made on the first collective
        sync and kept; it is made again when
        a member is no longer in it (a replica restarted, or joined another
        Syncer's group) or after a failed sync.
        """
        if self.config.transport is Transport.IPC:
            return IpcTransport.for_buckets_in_flight(self.config.max_buckets_in_flight)
        if self.config.transport is Transport.RAY:
            return "ray"
        timeout = self.config.timeout_s
        members = self._sources + self._replicas
        if self._group is not None:
            groups = raise_first_error(call_all(members, "transport_group", timeout_s=timeout))
            if all(g == self._group.rendezvous.group_id for g in groups):
                return self._group.rendezvous
            log.info("a member left collective group %s: making a new one", self._group.rendezvous.group_id)
            self._disconnect()
        ranks = raise_first_error(call_all(self._replicas, "transport_ranks", timeout_s=timeout))
        senders = [who for who, _ in self._sources]
        names = senders + [f"{who} worker {w}" for (who, _), n in zip(self._replicas, ranks) for w in range(n)]
        self._group = RendezvousHost(names, timeout, senders=len(senders))
        rendezvous = self._group.rendezvous
        offsets = [len(senders) + sum(ranks[:i]) for i in range(len(ranks))]
        pending = []
        for member, source in enumerate(self._sources):
            pending += submit_all([source], "join_transport", rendezvous, member)
        for replica, offset in zip(self._replicas, offsets):
            pending += submit_all([replica], "join_transport", rendezvous, offset, sync_id)
        # Members give up on a missing one at the deadline and name it: wait a little longer for that answer.
        try:
            raise_first_error(wait_all(pending, "join_transport", timeout_s=timeout + 10))
        except BaseException:
            self._disconnect()
            raise
        log.info("collective group %s: %d members (%s)", rendezvous.group_id, len(names), ", ".join(names))
        return rendezvous

    def _disconnect(self) -> None:
        """Every member leaves the group (bounded, best effort: a dead member has left already)."""
        group, self._group = self._group, None
        if group is None:
            return
        for outcome in call_all(self._sources + self._replicas, "leave_transport", timeout_s=self.config.timeout_s):
            if not outcome.ok:
                log.warning("%s could not leave collective group %s: %s", outcome.who, group.rendezvous.group_id, summary(outcome.error))
        group.close()

    def close(self) -> None:
        """Release what the Syncer holds between syncs: its collective group, if any."""
        self._disconnect()

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _probe_request(self) -> ProbeRequest:
        """The probe prompts for the rollout's vocabulary and the trainer's logprobs on them (its current weights)."""
        vocab = self._rollout_model.vocab_size
        if vocab is None:
            raise ConfigError("verify='probe' needs the rollout model's vocab_size, which its config.json lacks")
        prompts = probe_prompts(vocab)
        reference = raise_first_error(call_all(self._sources, "reference_logprobs", prompts, timeout_s=self.config.timeout_s))[0]
        return ProbeRequest(tuple(map(tuple, prompts)), tuple(map(tuple, reference)), fail=self.config.on_probe_breach == "fail")

    def _failed(self, sync_id: str, error: BaseException) -> BaseException:
        """Clean up after a failed sync; returns what to raise: `error`, or the death it echoes.

        Every replica's update is closed, and the collective group, which a
        broadcast may have left half-posted, is dropped (the next sync makes a
        new one). Members are asked whether they live first, so the error
        names a dead member whichever of its symptoms reached the driver first.
        """
        cause = error
        if isinstance(error, Exception):  # an interrupt is its own cause
            cause = _named_cause(error, dead_members(self._sources + self._replicas, grace_s=min(3.0, self.config.timeout_s)))
        self._abort(sync_id, cause)
        if self._group is not None:
            self._disconnect()
        log.warning("sync %s failed: %s\n  %s", sync_id, summary(cause), "\n  ".join(getattr(cause, "__notes__", [])))
        record_failure(verification_failed=isinstance(cause, VerificationError))
        return cause

    def _abort(self, sync_id: str, error: BaseException) -> None:
        """Close the update on every replica (bounded); attach what each was left doing to `error`."""
        reason = f"sync {sync_id} failed: {summary(error)}"
        outcomes = call_all(self._replicas, "abort_update", sync_id, reason, timeout_s=self.config.timeout_s)
        for outcome in outcomes:
            state = outcome.value if outcome.ok else f"could not be reached to abort ({outcome.error!r})"
            error.add_note(f"{outcome.who}: {state}")

    def _trainer_seconds(self) -> float | None:
        """The slowest rank's producing time. Optional in the protocol: custom trainers may not time themselves."""
        if not all(has_method(source, "last_stream_seconds") for _, source in self._sources):
            return None
        outcomes = call_all(self._sources, "last_stream_seconds", timeout_s=self.config.timeout_s)
        return max(o.value for o in outcomes) if all(o.ok for o in outcomes) else None


def sync(
    trainer: WeightSource, rollouts: RolloutReplica | Sequence[RolloutReplica], config: SyncConfig | None = None
) -> SyncReport:
    """One-off sync. For repeated syncs keep a `Syncer`: it plans (and makes its collective group) once."""
    with Syncer(trainer, rollouts, config) as syncer:
        return syncer.sync()


def _progress_bar(wanted: bool | None, total: int, description: str, unit: str = "actor") -> Any:
    """A bar on stderr when asked, or by default when stderr is a terminal; else a no-op."""
    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if wanted is None else wanted
    return tqdm(total=total, unit=unit, desc=description, disable=not show, leave=False)


def _named_cause(error: Exception, dead: list[ActorDiedError]) -> Exception:
    """What a failed sync raises when members are dead: the death of the first (trainer ranks, then replicas).

    An error that already names a dead member is kept (without the wrapper
    of the actor that relayed it); any other error becomes a note, as an echo.
    """
    if not dead:
        return error
    original = getattr(error, "cause", None) or error  # Ray's RayTaskError relays the remote exception as `cause`
    named = isinstance(original, ActorDiedError) and any(d.who == original.who for d in dead)
    cause = original if named else dead[0]
    if cause is not error:
        if not named:
            cause.add_note(f"echo of it: {summary(error)}")
        for note in getattr(error, "__notes__", []):
            cause.add_note(note)
    for other in dead:
        if other.who != cause.who:
            cause.add_note(f"also dead: {summary(other)}")
    return cause


def _class_name(cls: Any) -> str:
    # A Ray actor class keeps the decorated class's name in its metadata; repr() says "ActorClass(Name)".
    name = getattr(getattr(cls, "__ray_metadata__", None), "class_name", None) or getattr(cls, "__name__", None)
    return name or repr(cls)


def _refuse_actor_classes(members: list[tuple[str, Any]]) -> None:
    """A class where an actor is expected (`TrainerActor` for `TrainerActor.remote(...)`) fails far from here: name it."""
    try:
        from ray.actor import ActorClass
    except ImportError:  # a single-process setup without Ray
        ActorClass = type  # noqa: N806
    classes = [(who, m) for who, m in members if isinstance(m, (ActorClass, type))]
    problems = [f"{who} is the class {_class_name(m)}, not an actor: pass the handle {_class_name(m)}.remote(...) returns"
                for who, m in classes]
    if problems:
        raise ConfigError("refit syncs running actors:\n  " + "\n  ".join(problems))


def _weight_sources(trainer: Any) -> list[tuple[str, Any]]:
    """(name, source) of every rank that streams: a sharded trainer's `ranks`, or the trainer itself."""
    ranks = getattr(trainer, "ranks", None)
    if ranks is None or is_actor(trainer):
        return [("the trainer", trainer)]
    ranks = list(ranks)
    if not ranks:
        raise ConfigError("the sharded trainer has no ranks")
    return [(f"trainer rank {r}", rank) for r, rank in enumerate(ranks)]


def _merge_metadata(sources: list[tuple[str, Any]], metadata: list[list[TensorMeta]]) -> list[TensorMeta]:
    """The union of what the ranks hold (each may hold part of the names); the same name must agree everywhere."""
    merged: dict[str, tuple[str, TensorMeta]] = {}
    problems = []
    for (who, _), metas in zip(sources, metadata):
        for meta in metas:
            first = merged.setdefault(meta.name, (who, meta))
            if (first[1].shape, first[1].dtype) != (meta.shape, meta.dtype):
                problems.append(f"{meta.name}: {first[1].shape} {first[1].dtype} on {first[0]}, {meta.shape} {meta.dtype} on {who}")
    if problems:
        raise PlanMismatchError("the trainer's ranks disagree on tensors:\n  " + "\n  ".join(problems))
    return [meta for _, meta in merged.values()]


def _as_list(part: Any) -> list[Any]:
    return part if isinstance(part, list) else [part]


def _check_same_model(infos: list[RolloutModelInfo]) -> None:
    for i, info in enumerate(infos[1:], start=1):
        if info != infos[0]:
            raise ConfigError(
                f"rollout {i} runs a differently configured model than rollout 0 "
                "(quantization_config or tie_word_embeddings differ); use one Syncer per model"
            )

