"""`Syncer`: put a trainer's current weights into every rollout replica.

The whole flow of one sync, top to bottom:

1. plan (once, reused): trainer metadata + rollout model info ->
   `TransferPlan` (names, FP8_BLOCK decisions, tied alias, buckets);
2. every replica begins an update: it waits for in-flight requests, holds
   new ones, starts a layerwise reload, and proposes the lowest version it
   accepts; the sync's version is the highest proposal, so a version number
   never names two different sets of weights. One replica begins first,
   the same one for every Syncer, then the rest at once: of two syncs
   started together on the same replicas, one wins them all;
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
has a deadline (`SyncConfig.timeout_s`).

The replicas are a fleet that may change between syncs: `add_replica`
(checked like the constructor's, and against the plan's model; the next
sync sends it every weight) and `remove_replica`. Each is `rollout <id>`,
an id given when it joined and never reused. During a sync, a replica that
dies or misses the deadline is dropped: over `ray` the others go on with
the stream; over `collective` its loss breaks the group for everyone, so
the survivors' updates are aborted and they begin again, within the same
`sync()`, in a new group without it (at a higher version: none of them
served the abandoned one). The report's `dropped` names each one lost,
where and why, a warning says it, and it is no longer a member of the
Syncer. Only deaths and missed deadlines drop a replica: one that raises
(a failed check, a refused plan) fails the sync, as a trainer rank's
death does.

On a failure, at any step, including a driver interrupt and fewer than
`SyncConfig.min_replicas` replicas left, the trainer's stream is closed
and every remaining replica's update is aborted: a replica that received
nothing keeps serving its old version, one that did refuses to serve until
a later sync completes; the fleet is left as it was. The error raised is
the cause: when a member died, its death, whichever of its echoes (a broken
group, a lost object, a missed deadline) arrived first; the echoes and each
replica's resulting state are attached as notes.
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
from refit.errors import (
    ActorDiedError,
    BaseMismatchError,
    ConfigError,
    EngineError,
    GroupBroken,
    LifecycleError,
    PlanMismatchError,
    VerificationError,
)
from refit.orchestration.calls import (
    BucketStream,
    Outcome,
    call_all,
    dead_members,
    first_claim,
    is_actor,
    raise_first_error,
    submit_all,
    summary,
    wait_all,
    wait_until_started,
)
from refit.orchestration.fleet import Lost, Roll, broken_group, losses, replica_id, replica_name
from refit.orchestration.metrics import record_failure, record_sync
from refit.orchestration.report import ReplicaReport, SyncReport
from refit.plan.config import SyncConfig, Transport, Verify
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan, make_plan
from refit.protocols import RolloutReplica, WeightSource, accepts, has_method, missing_methods
from refit.transport.collective import JOIN_MARGIN_S, Rendezvous, RendezvousHost
from refit.transport.delta import DeltaMode, version_digest
from refit.transport.integrity import new_sync_key
from refit.transport.ipc import IpcTransport
from refit.verification.probe import ProbeRequest, probe_prompts

__all__ = ["Syncer", "sync"]

log = logging.getLogger("refit.orchestration")

_GROUP_METHODS = ("join_transport", "leave_transport", "transport_group")  # what transport='collective' calls on every member


class Syncer:
    """Repeated syncs from one weight source to a fleet of rollout replicas that may change between syncs.

    `trainer` and `rollouts` are Ray actor handles (or plain objects)
    implementing `WeightSource` and `RolloutReplica`. A sharded trainer is
    any object whose `ranks` are weight sources (`ShardedWeightSource`, e.g.
    `actors.TrainerGroup`): every rank streams its part of each bucket, and
    each replica fetches the parts straight from the ranks.

    Membership: the replicas given here are `rollout 0`, `rollout 1`, ...;
    `add_replica` and `remove_replica` change the fleet between syncs, and a
    sync that loses a replica (it died or missed `SyncConfig.timeout_s`)
    removes it. Ids are never reused, so a name always means one replica.
    """

    def __init__(
        self, trainer: WeightSource, rollouts: RolloutReplica | Sequence[RolloutReplica], config: SyncConfig | None = None
    ) -> None:
        self.trainer = trainer
        rollouts = list(rollouts) if isinstance(rollouts, (list, tuple)) else [rollouts]
        if not rollouts:
            raise ConfigError("Syncer needs at least one rollout replica")
        if config is not None and not isinstance(config, SyncConfig):
            raise ConfigError(f"config={config!r}: expected a refit.SyncConfig")
        members = [(replica_name(i), r) for i, r in enumerate(rollouts)]
        _refuse_actor_classes([("trainer", trainer), *members])
        self._sources = _weight_sources(trainer)
        self.config = config or SyncConfig()
        problems = [f"{who} lacks {m}()" for who, source in self._sources for m in missing_methods(source, WeightSource)]
        for who, replica in members:
            problems += self._replica_problems(who, replica)
        if self.config.verify is Verify.PROBE:
            problems += [f"{who} lacks reference_logprobs(), which verify='probe' needs"
                         for who, source in self._sources if not has_method(source, "reference_logprobs")]
        if self.config.transport is Transport.COLLECTIVE:
            problems += [f"{who} lacks {m}(), which transport='collective' needs"
                         for who, source in self._sources for m in _GROUP_METHODS if not has_method(source, m)]
        if problems:
            raise ConfigError("these actors cannot be synced (see refit.protocols):\n  " + "\n  ".join(problems))
        self._replicas = members  # the fleet: (name, handle), in the order they joined
        self._next_id = len(members)  # ids are never reused: a name in a log or report means one replica
        self._syncing = False
        self._plan: TransferPlan | None = None
        self._rollout_model: RolloutModelInfo | None = None
        self._group: RendezvousHost | None = None  # the collective group's rendezvous, held while the group lives
        self._group_replicas: tuple[str, ...] = ()  # the replicas whose workers are in that group
        self._started = False  # every actor has finished its constructor (awaited once)

    def _replica_problems(self, who: str, replica: Any) -> list[str]:
        """What `replica` lacks to be synced under this config: the protocol's methods, and the transport's."""
        problems = [f"{who} lacks {m}()" for m in missing_methods(replica, RolloutReplica)]
        if self.config.transport is Transport.COLLECTIVE:
            problems += [f"{who} lacks {m}(), which transport='collective' needs"
                         for m in (*_GROUP_METHODS, "transport_ranks") if not has_method(replica, m)]
        return problems

    # -- membership -------------------------------------------------------------------
    @property
    def rollouts(self) -> list[RolloutReplica]:
        """The replicas the next sync updates, in the order they joined."""
        return [replica for _, replica in self._replicas]

    @property
    def replica_names(self) -> list[str]:
        """Their names (`rollout <id>`), as errors, logs and reports give them."""
        return [who for who, _ in self._replicas]

    def add_replica(self, replica: RolloutReplica) -> str:
        """Add a replica to the fleet between syncs; returns its name. The next sync sends it every weight.

        It is checked as the constructor checks replicas (the protocol's
        methods, and the transport's), then, once it has started (waited for
        up to `SyncConfig.startup_timeout_s`), against the plan's rollout model
        if a plan was made, so a replica of another model is refused here
        rather than failing a sync of the whole fleet. Until the next sync
        completes it serves whatever it started with (a dummy-loaded engine
        refuses). Over `collective`, the next sync makes a new group with it.
        """
        self._refuse_during_sync("add_replica")
        if (member := self._find(replica)) is not None:
            raise ConfigError(f"this replica is already {member} of this Syncer")
        who = replica_name(self._next_id)
        _refuse_actor_classes([(who, replica)])
        problems = self._replica_problems(who, replica)
        if problems:
            raise ConfigError("this actor cannot be synced (see refit.protocols):\n  " + "\n  ".join(problems))
        wait_until_started([(who, replica)], timeout_s=self.config.startup_timeout_s)
        if self._plan is not None:
            (info,) = raise_first_error(call_all([(who, replica)], "describe", timeout_s=self.config.timeout_s))
            _check_same_model([("the plan's rollout model", self._rollout_model), (who, info)])
        self._next_id += 1
        self._replicas.append((who, replica))
        log.info("%s joined (%d replica(s)); the next sync sends it every weight", who, len(self._replicas))
        return who

    def remove_replica(self, replica: RolloutReplica | int | str) -> str:
        """Remove a replica from the fleet between syncs (by handle, id or name); returns its name.

        Nothing is called on it: it keeps serving what it serves, and may join
        another Syncer. Over `collective` its workers stay in this Syncer's
        group until they join another; the next sync makes a group without it.
        """
        self._refuse_during_sync("remove_replica")
        if isinstance(replica, int) and not isinstance(replica, bool):
            who = replica_name(replica)
        elif isinstance(replica, str):
            who = replica
        else:
            who = self._find(replica) or repr(replica)
        if who not in self.replica_names:
            raise ConfigError(f"{who!r} is not a replica of this Syncer; its replicas: {', '.join(self.replica_names) or 'none'}")
        self._replicas = [(name, handle) for name, handle in self._replicas if name != who]
        log.info("%s left (%d replica(s))", who, len(self._replicas))
        return who

    def _find(self, replica: Any) -> str | None:
        """The member name of `replica`: the same object, or a handle of the same actor (Ray handles compare by actor)."""
        return next((who for who, handle in self._replicas
                     if handle is replica or (is_actor(handle) and is_actor(replica) and handle == replica)), None)

    def _refuse_during_sync(self, method: str) -> None:
        if self._syncing:
            raise LifecycleError(
                f"{method}() during a sync: the fleet changes only between syncs; call it after sync() returns "
                "(a replica lost during a sync is dropped from the fleet by the sync itself)"
            )

    # -- the sync ---------------------------------------------------------------------
    def wait_until_started(self) -> float:
        """Wait for trainer ranks and replicas still being constructed (`SyncConfig.startup_timeout_s`); seconds waited.

        Once per Syncer, before its first remote call; `plan()` and `sync()`
        call it, and an RL loop may call it early to time its engines' start.
        (A replica added later is waited for by `add_replica`.)
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
            if not self._replicas:
                raise ConfigError("the Syncer has no replicas to plan for: add_replica() first")
            infos = raise_first_error(call_all(self._replicas, "describe", timeout_s=timeout))
            _check_same_model(list(zip(self.replica_names, infos)))
            metadata = raise_first_error(call_all(self._sources, "weight_metadata", timeout_s=timeout))
            self._plan = make_plan(_merge_metadata(self._sources, metadata), infos[0], self.config)
            self._rollout_model = infos[0]
        return self._plan

    def sync(self) -> SyncReport:
        """Put the trainer's current weights into every replica of the fleet; see the module docstring.

        A replica that dies or misses `SyncConfig.timeout_s` is dropped: the
        others complete the sync and serve its version, the report's
        `dropped` names it, and it is no longer a member of this Syncer. With
        fewer than `SyncConfig.min_replicas` left, or any other failure, the
        sync fails, every replica's update is aborted and the fleet is left
        as it was.
        """
        self._refuse_during_sync("sync")
        self._syncing = True
        try:
            return self._sync()
        finally:
            self._syncing = False

    def _sync(self) -> SyncReport:
        startup_seconds = self.wait_until_started()
        start = time.perf_counter()
        planned_before = self._plan is not None
        plan = self.plan()
        plan_seconds = 0.0 if planned_before else time.perf_counter() - start
        if len(self._replicas) < self.config.min_replicas:
            raise ConfigError(
                f"the Syncer has {len(self._replicas)} replica(s) and SyncConfig.min_replicas={self.config.min_replicas}: "
                "add replicas (add_replica) or lower min_replicas"
            )
        roll = Roll(self._replicas, self.config.min_replicas)
        stages: dict[str, float] = {}
        attempts = 0
        while True:  # one attempt per collective group; each attempt after the first has lost a member
            attempts += 1
            sync_id = uuid.uuid4().hex[:12]
            try:
                try:
                    version, load_seconds, finished, modes = self._attempt(plan, sync_id, roll, stages)
                    break
                except Exception as error:
                    lost = self._lost_with_the_group(error, roll)
                    if not lost:
                        if not (isinstance(error, BaseMismatchError) and attempts == 1):
                            raise
                        # A replica's base was not what its digest said: it dropped it, and the trainer's base has
                        # moved on, so every replica's next attempt is a full sync.
                        self._begin_again(sync_id, roll, error, "a replica's delta base did not rebuild the sender's bytes")
                        continue
                    roll.drop(lost, sync_id)
                    roll.check_quorum()
                    self._begin_again(sync_id, roll, error, "the collective group broke")
            except BaseException as error:
                cause = self._failed(sync_id, error, roll)
                if cause is error:
                    raise
                raise cause from None
        survivors = [who for who, _ in roll.members]
        self._replicas = [(who, handle) for who, handle in self._replicas if who in survivors]
        if roll.dropped:
            log.warning("sync %s v%d: %d replica(s) serve it (%.3f s); dropped from the fleet: %s", sync_id, version,
                        len(survivors), time.perf_counter() - start, "; ".join(map(str, roll.dropped)))
        else:
            log.info("sync %s v%d: every replica serves it (%.3f s)", sync_id, version, time.perf_counter() - start)

        wrong = [f"{who}: {f!r}" for who, f in finished.items() if not isinstance(f, FinishedUpdate)]
        if wrong:
            raise EngineError("finish_update must return a refit.engine.lifecycle.FinishedUpdate:\n  " + "\n  ".join(wrong))
        digest = self._sender_digest() if self.config.keeps_delta_base and self._sources_keep_bases() else None
        unequal = [who for who, f in finished.items() if digest is not None and f.digest not in (None, digest)]
        if unequal:
            log.warning("sync %s v%d: %s hold(s) a version whose digest differs from the trainer's %s; their next sync is "
                        "a full one", sync_id, version, ", ".join(unequal), digest)
        nodes = self._node_ids(roll.members)
        report = SyncReport(
            version=version,
            tensors=len(plan.tensors),
            buckets=len(plan.buckets),
            bytes_on_wire=plan.wire_bytes,
            plan_seconds=plan_seconds,
            trainer_seconds=self._trainer_seconds(),
            total_seconds=time.perf_counter() - start,
            replicas=tuple(
                ReplicaReport(replica_id(who), nodes[who], version, load_seconds.get(who, 0.0), f.seconds,
                              f.kv_scales_written, f.verification, modes.get(who, "full"), f.bytes_received, f.digest)
                for who, f in finished.items()
            ),
            begin_seconds=stages["begin"],
            stream_seconds=stages["stream"],
            finish_seconds=stages["finish"],
            probe_breached=any(f.probe_passed is False for f in finished.values()),
            startup_seconds=startup_seconds,
            dropped=tuple(roll.dropped),
            attempts=attempts,
            digest=digest,
        )
        if report.probe_breached:
            log.warning("sync %s v%d: the logprob probe breached its thresholds (flagged, not failed)", sync_id, version)
        record_sync(report, verified=self.config.verify is not Verify.OFF, syncer=self.config.metrics_tag)
        return report

    def _attempt(
        self, plan: TransferPlan, sync_id: str, roll: Roll, stages: dict[str, float]
    ) -> tuple[int, dict[str, float], dict[str, FinishedUpdate], dict[str, str]]:
        """Begin, stream and finish on the roll's members; returns the version, each one's load seconds, finish and mode.

        Members lost on the way are dropped from `roll`, except mid-broadcast
        over `collective` (`GroupBroken`: every member must begin again).
        """
        timeout = self.config.timeout_s
        # Each attempt's own secret for its bytes' tags: it reaches the trainer and the replicas inside the plan, over
        # Ray (refit/transport/integrity.py); a tag of an earlier attempt or sync verifies in none after it.
        plan = plan.for_sync(new_sync_key() if self.config.verify is not Verify.OFF else None)
        stage = time.perf_counter()
        roll.stage = "begin"
        first = first_claim(roll.members)  # one winner when two syncs start at once (`first_claim`)
        others = [m for m in roll.members if m is not first]  # the Syncer's order: errors come in the same order every run
        begin = ("begin_update", plan, sync_id, self.config)
        proposals = roll.settle(call_all([first], *begin, timeout_s=timeout), sync_id)
        if others:
            proposals |= roll.settle(call_all(others, *begin, timeout_s=timeout), sync_id)
        version = max(proposals.values())
        # After begin: a rival sync refused by the replicas never gets to take the trainer into its group.
        roll.stage = "connect"
        transport = self._connect(sync_id, roll.members)
        stream_mode, modes = self._delta_modes(roll)
        stages["begin"], stage = time.perf_counter() - stage, time.perf_counter()
        log.debug("sync %s v%d: began on %d replica(s) (%s)", sync_id, version, len(roll.members), stream_mode)
        roll.stage = "stream"
        load_seconds = self._stream(plan, sync_id, version, transport, roll, stream_mode, modes)
        stages["stream"], stage = time.perf_counter() - stage, time.perf_counter()
        log.debug("sync %s v%d: streamed %d bucket(s), %.1f MiB per replica", sync_id, version, len(plan.buckets),
                  plan.wire_bytes / 2**20)
        probe = () if self.config.verify is not Verify.PROBE else (self._probe_request(),)
        roll.stage = "finish"
        finished = roll.settle(call_all(roll.members, "finish_update", sync_id, version, *probe, timeout_s=timeout), sync_id)
        stages["finish"] = time.perf_counter() - stage
        return version, load_seconds, finished, modes

    def _stream(self, plan: TransferPlan, sync_id: str, version: int, transport: Rendezvous | IpcTransport | str,
                roll: Roll, delta: DeltaMode | None, modes: dict[str, str]) -> dict[str, float]:
        """Hand each bucket to every member as it is produced; bounded in flight, every wait bounded; load seconds by name.

        Over `collective` and `ipc` the driver reads each bucket's contents
        and looks one bucket ahead, so that a worker can post the receive of
        the next bucket before it loads this one. Over `ray` (and `ipc`) a
        lost member is dropped and the others go on (each fetches its own
        copy); over `collective` its loss breaks every member's broadcasts
        (`GroupBroken`).
        """
        timeout = self.config.timeout_s
        in_flight: collections.deque[list[tuple[str, Any]]] = collections.deque()
        seconds = dict.fromkeys((who for who, _ in roll.members), 0.0)
        by_contents = transport != Transport.RAY
        one_group = isinstance(transport, Rendezvous)  # every member's broadcasts break with one member

        def wait_oldest() -> None:
            pending = [(who, ref) for who, ref in in_flight.popleft() if roll.has(who)]  # none for the dropped
            outcomes = wait_all(pending, "load_bucket", timeout_s=timeout, until_a_death=one_group)
            lost = losses(outcomes)
            if lost and one_group:
                raise broken_group(lost)
            for who, spent in roll.settle(outcomes, sync_id).items():
                seconds[who] += spent
            progress.update()

        def ended_early(parts: list[Any]) -> PlanMismatchError:
            while in_flight:  # a trainer that failed ended its stream: the loads raise its error first
                wait_oldest()
            ended = sorted({who for (who, _), part in zip(self._sources * 2, parts) if part is None})
            return PlanMismatchError(f"{', '.join(ended)} ended the stream before the plan's {len(plan.buckets)} buckets")

        streams = [BucketStream(source, plan, self.config.max_buckets_in_flight, transport, who=who, delta=delta)
                   for who, source in self._sources]
        by_mode = {mode: [(who, r) for who, r in roll.members if modes.get(who, "full") == mode] for mode in ("full", "delta")}
        progress = _progress_bar(self.config.progress, len(plan.buckets), f"refit sync v{version}", unit="bucket")
        try:
            upcoming = [stream.next(timeout, fetch=True) for stream in streams] if by_contents else []
            for index in range(len(plan.buckets)):
                if by_contents:  # each rank's contents of this bucket, and of the one after
                    parts = upcoming
                    upcoming = [stream.next(timeout, fetch=True) for stream in streams] if index + 1 < len(plan.buckets) else []
                    delta_parts = parts
                else:
                    parts = [stream.next(timeout) for stream in streams]  # one part per rank (one rank: the bucket)
                    # In "both" mode each rank yields the whole part, then its delta.
                    delta_parts = [stream.next(timeout) for stream in streams] if delta is DeltaMode.BOTH else parts
                if any(part is None for part in parts + delta_parts):
                    raise ended_early(parts + delta_parts)
                submitted = []
                for members, sent in ((by_mode["full"], parts), (by_mode["delta"], delta_parts)):
                    if by_contents:
                        args = (sent, [None if part is None else part.nbytes for part in upcoming or [None] * len(sent)])
                    else:
                        args = (sent[0] if len(sent) == 1 else [ref for part in sent for ref in _as_list(part)],)
                    submitted += submit_all([(who, r) for who, r in members if roll.has(who)], "load_bucket", sync_id, version, *args)
                in_flight.append(submitted)
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

    def _lost_with_the_group(self, error: Exception, roll: Roll) -> list[Lost]:
        """Over `collective`, the replicas whose loss broke the group (so the survivors may begin again); else none.

        A broken group reaches the driver as a missed deadline on the lost
        member (`GroupBroken`) or, often first, as its echoes: the trainer's
        failed broadcast, a survivor's failed receive, a join that timed out.
        Members are then asked whether they live; a dead trainer rank, or no
        dead replica, leaves the error a failure of the sync.
        """
        if self.config.transport is not Transport.COLLECTIVE or roll.stage not in ("connect", "stream"):
            return []
        if isinstance(error, GroupBroken):
            return error.lost
        dead = dead_members(self._sources + roll.members, grace_s=min(3.0, self.config.timeout_s))
        if not dead or any(d.who in dict(self._sources) for d in dead):
            return []
        return [(d.who, "died", d) for d in dead]

    def _begin_again(self, sync_id: str, roll: Roll, error: BaseException, why: str) -> None:
        """After the group broke (or a delta base failed): close the survivors' updates and the group, so the
        next attempt begins afresh.

        Each survivor may still be waiting for a broadcast that never comes
        (up to the group's deadline, `timeout_s`) before it takes the abort:
        the abort's deadline is twice that. The next attempt's version is
        above this one's, and nobody served this one: versions never mix.
        """
        log.warning("sync %s: %s (%s); %d replica(s) begin again", sync_id, why, summary(error), len(roll.members))
        reason = f"sync {sync_id}: {why} ({summary(error)}); beginning again"
        outcomes = call_all(roll.members, "abort_update", sync_id, reason, timeout_s=2 * self.config.timeout_s)
        roll.drop(losses(outcomes), sync_id)
        roll.check_quorum()
        self._disconnect(roll.members)

    # -- delta syncs (refit/transport/delta.py) ------------------------------------
    def _delta_modes(self, roll: Roll) -> tuple[DeltaMode | None, dict[str, str]]:
        """What the trainer streams, and which replicas get deltas: those whose base digest is the trainer's.

        A source without `base_entries` (a custom trainer) is streamed as
        before (None), and every replica gets everything. Over `collective`
        one broadcast reaches every replica, so a fleet that differs gets
        whole buckets; over `ray` each replica fetches the kind it needs.
        """
        if not self._sources_keep_bases():
            return None, {}
        if not self.config.keeps_delta_base:
            return DeltaMode.OFF, {}
        digest = self._sender_digest()
        transport = str(self.config.transport)
        askable = [(who, r) for who, r in roll.members if has_method(r, "base_digest")]
        held = {o.who: o.value for o in call_all(askable, "base_digest", transport, timeout_s=self.config.timeout_s) if o.ok}
        modes = {who: "delta" if digest is not None and held.get(who) == digest else "full" for who, _ in roll.members}
        if all(mode == "full" for mode in modes.values()):
            return DeltaMode.FULL, modes
        if all(mode == "delta" for mode in modes.values()):
            return DeltaMode.DELTA, modes
        if self.config.transport is Transport.RAY:
            return DeltaMode.BOTH, modes
        log.info("delta sync: %s hold(s) another version than the trainer's last; over one broadcast every replica "
                 "gets whole buckets", ", ".join(who for who, mode in modes.items() if mode == "full"))
        return DeltaMode.FULL, dict.fromkeys(modes, "full")

    def _sources_keep_bases(self) -> bool:
        """Every rank keeps a delta base and streams deltas (see `refit.protocols.WeightSource`)."""
        return all(has_method(source, "base_entries") and accepts(source, "stream_buckets", "delta")
                   for _, source in self._sources)

    def _sender_digest(self) -> str | None:
        """The digest of what the trainer's ranks last streamed (None before their first stream)."""
        entries = raise_first_error(call_all(self._sources, "base_entries", timeout_s=self.config.timeout_s))
        merged = [tuple(entry[:3]) + (tuple(entry[3]),) + tuple(entry[4:]) for rank in entries for entry in rank]
        return version_digest(merged) if merged else None

    # -- the collective group ---------------------------------------------------
    def _connect(self, sync_id: str, members: list[tuple[str, Any]]) -> Rendezvous | IpcTransport | str:
        """What the trainer's stream is told to send over: "ray", an `IpcTransport`, or the collective group's rendezvous.

        The group (the sending trainer ranks, then every worker of every
        replica of this sync; a channel per sending rank) is made on the
        first collective sync and kept; it is made again when the fleet
        changed, when a member is no longer in it (a replica restarted, or
        joined another Syncer's group) or after a failed sync.
        """
        if self.config.transport is Transport.IPC:
            return IpcTransport.for_buckets_in_flight(self.config.max_buckets_in_flight)
        if self.config.transport is Transport.RAY:
            return "ray"
        timeout = self.config.timeout_s
        if self._group is not None:
            same_fleet = self._group_replicas == tuple(who for who, _ in members)
            groups = self._group_answers(call_all(self._sources + members, "transport_group", timeout_s=timeout)) if same_fleet else []
            if same_fleet and all(g == self._group.rendezvous.group_id for g in groups):
                return self._group.rendezvous
            log.info("collective group %s: %s; making a new one", self._group.rendezvous.group_id,
                     "a member left it" if same_fleet else "the fleet changed")
            self._disconnect(members)
        ranks = self._group_answers(call_all(members, "transport_ranks", timeout_s=timeout))
        senders = [who for who, _ in self._sources]
        names = senders + [f"{who} worker {w}" for (who, _), n in zip(members, ranks) for w in range(n)]
        self._group = RendezvousHost(names, timeout, senders=len(senders))
        self._group_replicas = tuple(who for who, _ in members)
        rendezvous = self._group.rendezvous
        offsets = [len(senders) + sum(ranks[:i]) for i in range(len(ranks))]
        pending = []
        for member, source in enumerate(self._sources):
            pending += submit_all([source], "join_transport", rendezvous, member)
        for replica, offset in zip(members, offsets):
            pending += submit_all([replica], "join_transport", rendezvous, offset, sync_id)
        # Members give up on a missing one at the deadline and name it: wait longer for that answer, relayed or not
        # (JOIN_MARGIN_S), unless a member is gone: then the others are told at once (`abandon`), not left to wait it out.
        try:
            self._group_answers(wait_all(pending, "join_transport", timeout_s=timeout + 2 * JOIN_MARGIN_S, until_a_death=True))
        except BaseException as error:
            self._group.abandon(f"{summary(error)}; the sync begins again or fails")
            # The members leave it in `_begin_again` or `_failed`, once the roll has dropped those lost: a hung one,
            # asked here, would hold the sync for another `timeout_s` (a hung `vllm serve` cost two deadlines, not one).
            raise
        log.info("collective group %s: %d members (%s)", rendezvous.group_id, len(names), ", ".join(names))
        return rendezvous

    def _group_answers(self, outcomes: list[Outcome]) -> list[Any]:
        """The answers to a call that checks or forms the collective group; a replica lost meanwhile raises `GroupBroken`.

        Why not the first error: a replica lost while the group forms (its
        actor dead, its `vllm serve` server gone while the actor lives, or
        silent) fails the others' joins as an echo, and its actor may still
        answer Ray. Acting on the loss lets the survivors begin again without
        it, as a loss mid-broadcast does. A trainer rank lost is no replica's
        loss: the replicas' missing answers are its echo.
        """
        senders = dict(self._sources)
        lost = losses(outcomes)
        if not lost:
            return raise_first_error(outcomes)
        broken = broken_group(lost)  # after a death, the others' missing answers (a trainer's too) are its echo
        if any(who in senders for who, _, _ in broken.lost):  # a trainer rank lost fails the sync, by name
            return raise_first_error(outcomes)
        raise broken

    def _disconnect(self, members: list[tuple[str, Any]] | None = None) -> None:
        """The trainer ranks and `members` (default: the fleet) leave the group (bounded, best effort: a dead member has left already)."""
        group, self._group, self._group_replicas = self._group, None, ()
        if group is None:
            return
        members = self._replicas if members is None else members
        for outcome in call_all(self._sources + members, "leave_transport", timeout_s=self.config.timeout_s):
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

    def _failed(self, sync_id: str, error: BaseException, roll: Roll) -> BaseException:
        """Clean up after a failed sync; returns what to raise: `error`, or the death it echoes.

        Every remaining member's update is closed, and the collective group,
        which a broadcast may have left half-posted, is dropped (the next sync
        makes a new one). Members are asked whether they live first, so the
        error names a dead member whichever of its symptoms reached the driver
        first. The fleet is left as it was: a failed sync drops nobody.
        """
        cause = error
        if isinstance(error, Exception):  # an interrupt is its own cause
            cause = _named_cause(error, dead_members(self._sources + roll.members, grace_s=min(3.0, self.config.timeout_s)))
        self._abort(sync_id, cause, roll.members)
        for dropped in roll.dropped:
            cause.add_note(f"{replica_name(dropped.replica)}: lost ({dropped.cause} at {dropped.stage}); still a member of the Syncer")
        if self._group is not None:
            self._disconnect(roll.members)
        log.warning("sync %s failed: %s\n  %s", sync_id, summary(cause), "\n  ".join(getattr(cause, "__notes__", [])))
        record_failure(verification_failed=isinstance(cause, VerificationError), syncer=self.config.metrics_tag)
        return cause

    def _abort(self, sync_id: str, error: BaseException, members: list[tuple[str, Any]]) -> None:
        """Close the update on every member (bounded); attach what each was left doing to `error`."""
        reason = f"sync {sync_id} failed: {summary(error)}"
        outcomes = call_all(members, "abort_update", sync_id, reason, timeout_s=self.config.timeout_s)
        for outcome in outcomes:
            state = outcome.value if outcome.ok else f"could not be reached to abort ({outcome.error!r})"
            error.add_note(f"{outcome.who}: {state}")

    def _node_ids(self, members: list[tuple[str, Any]]) -> dict[str, str]:
        """Where each member runs; "" for one that no longer answers (the sync is done: that is no reason to fail it)."""
        return {o.who: o.value if o.ok else "" for o in call_all(members, "node_id", timeout_s=self.config.timeout_s)}

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


def _check_same_model(infos: list[tuple[str, RolloutModelInfo]]) -> None:
    """Every (name, model info) describes the first one's model: one plan serves them all."""
    first_who, first = infos[0]
    for who, info in infos[1:]:
        if info != first:
            raise ConfigError(
                f"{who} runs a differently configured model than {first_who} "
                "(quantization_config or tie_word_embeddings differ); use one Syncer per model"
            )
