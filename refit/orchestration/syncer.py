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
   soon as it exists, so quantizing bucket i+1 overlaps loading bucket i.
   Its stream starts as soon as the first replica began, so the first
   buckets are made while the rest begin (over `collective`: once every
   replica began and joined the group);
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

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from refit.engine.lifecycle import FinishedUpdate
from refit.errors import BaseMismatchError, ConfigError, LifecycleError, PlanMismatchError
from refit.orchestration.adapter_sync import sync_adapter
from refit.orchestration.calls import Outcome, call_all, call_groups, first_claim, raise_first_error
from refit.orchestration.collective_group import CollectiveGroupLifecycle
from refit.orchestration.delta_negotiation import DeltaNegotiation
from refit.orchestration.failures import failed
from refit.orchestration.fleet import Roll
from refit.orchestration.membership import Membership, check_same_model, checked_sources, wait_for_actors
from refit.orchestration.metrics import record_sync
from refit.orchestration.report import AdapterSyncReport, SyncReport
from refit.orchestration.reporting import Attempt, check_finished, report_questions, sync_report
from refit.orchestration.streaming import BucketRelay
from refit.orchestration.transport_choice import pick_transport
from refit.plan.config import SyncConfig, Transport, Verify
from refit.plan.tensors import TensorMeta, checked_metadata
from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan, make_plan
from refit.protocols import RolloutReplica, WeightSource, has_method
from refit.transport.delta import DeltaMode
from refit.transport.integrity import new_sync_key
from refit.verification.probe import ProbeRequest, probe_prompts

__all__ = ["Syncer", "sync"]

_FLEET_CHANGES = ("add_replica", "remove_replica")

log = logging.getLogger("refit.orchestration")


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
        self.config = config or SyncConfig()
        self._fleet = Membership(rollouts, self.config)
        self._sources = checked_sources(trainer, self._fleet)
        self._group = CollectiveGroupLifecycle(self._sources, self.config)
        self._delta = DeltaNegotiation(self._sources, self.config)
        # transport="auto": `self.config` names the transport picked for the fleet `_picked_for` (`_pick_transport`).
        self._auto_transport = self.config.transport is Transport.AUTO
        self._picked_for: tuple[str, ...] | None = None
        self._transport_reason = "" if self._auto_transport else "set by SyncConfig.transport"
        self._busy = threading.Lock()  # held by the one sync, adapter sync or fleet change running (`_alone`)
        self._running: str | None = None
        self._plan: TransferPlan | None = None
        self._rollout_model: RolloutModelInfo | None = None
        self._started = False  # every actor has finished its constructor (awaited once)
        self._adapter_version = 0  # of the last adapter sync
        self._nodes: dict[str, str] = {}  # replica name -> the Ray node it runs on (an actor never moves)

    # -- membership (refit/orchestration/membership.py) -----------------------------------
    @property
    def rollouts(self) -> list[RolloutReplica]:
        """The replicas the next sync updates, in the order they joined."""
        return [replica for _, replica in self._fleet.members]

    @property
    def replica_names(self) -> list[str]:
        """Their names (`rollout <id>`), as errors, logs and reports give them."""
        return self._fleet.names

    def add_replica(self, replica: RolloutReplica) -> str:
        """Add a replica to the fleet between syncs; returns its name. The next sync sends it every weight.

        It is checked as the constructor checks replicas (the protocol's
        methods, and the transport's), then, once it has started (waited for
        up to `SyncConfig.startup_timeout_s`), against the fleet's rollout model
        once the fleet was described (by a plan or an adapter sync), so a replica of another model is refused here
        rather than failing a sync of the whole fleet. Until the next sync
        completes it serves whatever it started with (a dummy-loaded engine
        refuses). Over `collective`, the next sync makes a new group with it.
        """
        with self._alone("add_replica"):
            return self._fleet.add(replica, self._rollout_model)  # known once the fleet was described

    def remove_replica(self, replica: RolloutReplica | int | str) -> str:
        """Remove a replica from the fleet between syncs (by handle, id or name); returns its name.

        Nothing is called on it: it keeps serving what it serves, and may join
        another Syncer. Over `collective` its workers stay in this Syncer's
        group until they join another; the next sync makes a group without it.
        """
        with self._alone("remove_replica"):
            return self._fleet.remove(replica)

    @contextlib.contextmanager
    def _alone(self, method: str) -> Iterator[None]:
        """Run `method` while nothing else of this Syncer runs, or refuse it at once, naming what runs.

        Why a lock, not a flag: a driver's threads may share a Syncer, and two
        of them could both find a flag clear and run two syncs over one
        Syncer's fleet, group and delta bookkeeping. A replica, a fleet or a
        collective group changes only between syncs, from whichever thread.
        """
        if not self._busy.acquire(blocking=False):
            why = ("the fleet changes only between syncs; call it after that returns (a replica lost during a sync is "
                   "dropped from the fleet by the sync itself)") if method in _FLEET_CHANGES else \
                "a Syncer runs one sync at a time; call it after that returns, or use a Syncer per thread"
            raise LifecycleError(f"{method}() during this Syncer's {self._running}(): {why}")
        self._running = method
        try:
            yield
        finally:
            self._running = None
            self._busy.release()

    @property
    def transport(self) -> str | None:
        """The transport the next sync takes; with `transport="auto"`, None until the first sync picks one."""
        return None if self.config.transport is Transport.AUTO else str(self.config.transport)

    def _pick_transport(self, roll: Roll) -> None:
        """With `transport="auto"`: pick one for the fleet (refit/orchestration/transport_choice.py), before the first
        sync and after the fleet changed; a collective group is left when the fleet goes back to `ray`. A replica lost
        while asked is dropped from `roll`."""
        if not self._auto_transport or self._picked_for == tuple(self._fleet.names):
            return
        name, self._transport_reason = pick_transport(self._sources, roll, self.config)
        if self.transport != name:
            # Not a replica the pick dropped: it did not answer there, and asking it again costs another deadline.
            self._group.disconnect(roll.members)
            # The fleet keeps `auto`: a replica added later is checked for what some transport needs, and the next
            # sync picks again for the changed fleet.
            self.config = replace(self.config, transport=name)
            self._group = CollectiveGroupLifecycle(self._sources, self.config)
            self._delta = DeltaNegotiation(self._sources, self.config)
        # Picked for those that answered: one the pick dropped, still a member if the sync fails later, was not heard,
        # so the next sync asks again rather than sending it over a transport picked without it.
        self._picked_for = tuple(who for who, _ in roll.members)

    # -- the sync ---------------------------------------------------------------------
    def wait_until_started(self) -> float:
        """Wait for trainer ranks and replicas still being constructed (`SyncConfig.startup_timeout_s`); seconds waited.

        Once per Syncer, before its first remote call; `plan()` and `sync()`
        call it, and an RL loop may call it early to time its engines' start.
        (A replica added later is waited for by `add_replica`.)
        """
        if self._started:
            return 0.0
        seconds = wait_for_actors(self._sources + self._fleet.members, self.config)
        self._started = True
        return seconds

    def plan(self) -> TransferPlan:
        """The transfer plan, made on first use from both sides' metadata."""
        self.wait_until_started()
        if self._plan is None:
            timeout = self.config.timeout_s
            if not self._fleet.members:
                raise ConfigError("the Syncer has no replicas to plan for: add_replica() first")
            rollout = self._describe_rollouts()
            metadata = raise_first_error(call_all(self._sources, "weight_metadata", timeout_s=timeout))
            self._plan = make_plan(_merge_metadata(self._sources, metadata), rollout, self.config)
        return self._plan

    def _describe_rollouts(self) -> RolloutModelInfo:
        """The rollout model every replica runs (they must agree), asked once."""
        if self._rollout_model is None:
            infos = raise_first_error(call_all(self._fleet.members, "describe", timeout_s=self.config.timeout_s))
            check_same_model(list(zip(self.replica_names, infos)))
            self._rollout_model = infos[0]
        return self._rollout_model

    def sync_adapter(self) -> AdapterSyncReport:
        """Put the trainer's LoRA adapter, and nothing else, into every replica: staged on all, then served by all
        (refit/orchestration/adapter_sync.py). The base weights are not touched; requests running finish on the old
        adapter. Replicas lost on the way are dropped as in `sync`. Any other failure before the serve step leaves
        every replica serving the adapter it served; one during the serve step can leave some replicas on the new
        adapter and the rest on their old one, as each serves it on its own (docs/lora.md)."""
        with self._alone("sync_adapter"):
            self.wait_until_started()
            if not self._fleet.members:
                raise ConfigError("the Syncer has no replicas: add_replica() first")
            roll = Roll(self._fleet.members, self.config.min_replicas)
            report = sync_adapter(self._sources, roll, self._describe_rollouts(), self.config, self._adapter_version)
            self._fleet.keep(roll.members)
            self._adapter_version = report.version
            return report

    def sync(self) -> SyncReport:
        """Put the trainer's current weights into every replica of the fleet; see the module docstring.

        A replica that dies or misses `SyncConfig.timeout_s` is dropped: the
        others complete the sync and serve its version, the report's
        `dropped` names it, and it is no longer a member of this Syncer. With
        fewer than `SyncConfig.min_replicas` left, or any other failure, the
        sync fails, every replica's update is aborted and the fleet is left
        as it was.
        """
        with self._alone("sync"):
            return self._sync()

    def _sync(self) -> SyncReport:
        startup_seconds = self.wait_until_started()
        start = time.perf_counter()
        planned_before = self._plan is not None
        plan = self.plan()
        plan_seconds = 0.0 if planned_before else time.perf_counter() - start
        if len(self._fleet.members) < self.config.min_replicas:
            raise ConfigError(
                f"the Syncer has {len(self._fleet.members)} replica(s) and SyncConfig.min_replicas={self.config.min_replicas}: "
                "add replicas (add_replica) or lower min_replicas"
            )
        roll = Roll(self._fleet.members, self.config.min_replicas)
        self._pick_transport(roll)
        # Asked of the trainer before any replica begins (its weights do not change during a sync), so a probe that
        # cannot be made fails the sync with every replica still serving, not after every bucket loaded.
        probe = None if self.config.verify is not Verify.PROBE else self._probe_request()
        stages: dict[str, float] = {}
        done = self._attempts(plan, roll, stages, probe)
        self._fleet.keep(roll.members)
        if roll.dropped:
            log.warning("sync %s v%d: %d replica(s) serve it (%.3f s); dropped from the fleet: %s", done.sync_id, done.version,
                        len(roll.members), time.perf_counter() - start, "; ".join(map(str, roll.dropped)))
        else:
            log.info("sync %s v%d: every replica serves it (%.3f s over %s)", done.sync_id, done.version,
                     time.perf_counter() - start, self.config.transport)
        check_finished(done.finished)
        entries, *answers = done.answers
        digest = self._delta.settled(done.sync_id, done.version, done.finished, entries)
        report = sync_report(plan, done, roll, stages, answers, self._nodes, start=start, startup_seconds=startup_seconds,
                             plan_seconds=plan_seconds, digest=digest,
                             transport=(str(self.config.transport), self._transport_reason))
        if report.probe_breached:
            log.warning("sync %s v%d: the logprob probe breached its thresholds (flagged, not failed)", done.sync_id, done.version)
        record_sync(report, verified=self.config.verify is not Verify.OFF, syncer=self.config.metrics_tag)
        return report

    def _attempts(self, plan: TransferPlan, roll: Roll, stages: dict[str, float], probe: ProbeRequest | None) -> Attempt:
        """Attempt the sync until every member finished it; over `collective` each attempt after the first lost a member.

        A failure that is no such loss (or a second wrong delta base) fails
        the sync, raising its cause (refit/orchestration/failures.py).
        """
        attempts = 0
        while True:  # one attempt per collective group
            attempts += 1
            sync_id = uuid.uuid4().hex[:12]
            try:
                try:
                    return Attempt(sync_id, attempts, *self._attempt(plan, sync_id, roll, stages, probe))
                except Exception as error:
                    lost = self._group.lost_with_it(error, roll)
                    if not lost:
                        if not (isinstance(error, BaseMismatchError) and attempts == 1):
                            raise
                        # A replica's base was not what its digest said: it dropped it, and the trainer's base has
                        # moved on, so every replica's next attempt is a full sync.
                        self._group.begin_again(sync_id, roll, error, "a replica's delta base did not rebuild the sender's bytes")
                        continue
                    roll.drop(lost, sync_id)
                    roll.check_quorum()
                    self._group.begin_again(sync_id, roll, error, "the collective group broke")
            except BaseException as error:
                cause = failed(sync_id, error, roll, self._sources, self.config, self._group.disconnect)
                if cause is error:
                    raise
                raise cause from None

    def _attempt(
        self, plan: TransferPlan, sync_id: str, roll: Roll, stages: dict[str, float], probe: ProbeRequest | None
    ) -> tuple[int, dict[str, float], dict[str, FinishedUpdate], dict[str, str], list[list[Outcome]]]:
        """Begin, stream and finish on the roll's members; returns the version, each one's load seconds, finish and mode,
        and the answers to what the report asks (`Attempt.answers`).

        Members lost on the way are dropped from `roll`, except mid-broadcast
        over `collective` (`GroupBroken`: every member must begin again).
        """
        timeout = self.config.timeout_s
        # Each attempt's own secret for its bytes' tags: it reaches the trainer and the replicas inside the plan, over
        # Ray (refit/transport/integrity.py); a tag of an earlier attempt or sync verifies in none after it.
        plan = plan.for_sync(new_sync_key() if self.config.verify is not Verify.OFF else None, sync_id, timeout)
        stage = time.perf_counter()
        roll.stage = "begin"
        first = first_claim(roll.members)  # one winner when two syncs start at once (`first_claim`)
        others = [m for m in roll.members if m is not first]  # the Syncer's order: errors come in the same order every run
        begin = ("begin_update", (plan, sync_id, self.config))
        # The first claim and the delta negotiation's questions (which only read), in one round.
        claimed, *answers = call_groups([([first], *begin), *self._delta.questions(roll)], timeout_s=timeout)
        proposals = roll.settle(claimed, sync_id)
        relay = BucketRelay(plan, sync_id, roll, self._sources, self.config)
        try:
            # Once the first claim is won no rival sync streams to this fleet, so the trainer may start making buckets
            # while the others begin; unless the stream goes over a group, which forms only after every member began
            # (a rival sync refused by the replicas never gets to take the trainer into its group).
            early = not self.config.transport_kind.traits.one_group
            if early:
                stream_mode, modes = self._open_stream(relay, sync_id, roll, answers)
            proposals |= roll.settle(call_all(others, begin[0], *begin[1], timeout_s=timeout), sync_id)
            version = max(proposals.values())
            if not early:
                roll.stage = "connect"
                stream_mode, modes = self._open_stream(relay, sync_id, roll, answers)
            stages["begin"], stage = time.perf_counter() - stage, time.perf_counter()
            log.debug("sync %s v%d: began on %d replica(s) (%s)", sync_id, version, len(roll.members), stream_mode)
            roll.stage = "stream"
            load_seconds = relay.run(version, modes)
        finally:
            relay.close()
        stages["stream"], stage = time.perf_counter() - stage, time.perf_counter()
        log.debug("sync %s v%d: streamed %d bucket(s), %.1f MiB per replica", sync_id, version, len(plan.buckets),
                  plan.wire_bytes / 2**20)
        roll.stage = "finish"
        # What the report and the delta bookkeeping ask, in finish's round: the trainer's stream is over, so its
        # base and stats are final, and a replica's node never changes.
        finishing, *answers = call_groups([(roll.members, "finish_update", (sync_id, version, *(() if probe is None else (probe,)))),
                                           (self._delta.entry_sources(), "base_entries", ()),
                                           *report_questions(roll, self._sources, self._nodes)], timeout_s=timeout)
        finished = roll.settle(finishing, sync_id)
        stages["finish"] = time.perf_counter() - stage
        return version, load_seconds, finished, modes, answers

    def _open_stream(self, relay: BucketRelay, sync_id: str, roll: Roll,
                     answers: list[list[Outcome]]) -> tuple[DeltaMode | None, dict[str, str]]:
        """Connect the roll's members for the transport, decide what the trainer streams and which members get deltas
        (from `answers` to the delta negotiation's questions), and start the trainer's stream."""
        transport = self._group.connect(sync_id, roll.members)
        stream_mode, modes = self._delta.modes(roll, answers)
        relay.open(transport, stream_mode)
        return stream_mode, modes

    def close(self) -> None:
        """Release what the Syncer holds between syncs: its collective group, if any."""
        with self._alone("close"):
            self._group.disconnect(self._fleet.members)

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
        # A rollout that serves LoRA is sent the base alone (`TransferPlan.lora_served`), and scores the probe on it.
        base_only = self._rollout_model.serves_lora and all(has_method(s, "base_reference_logprobs") for _, s in self._sources)
        method = "base_reference_logprobs" if base_only else "reference_logprobs"
        reference = raise_first_error(call_all(self._sources, method, prompts, timeout_s=self.config.timeout_s))[0]
        return ProbeRequest(tuple(map(tuple, prompts)), tuple(map(tuple, reference)), fail=self.config.on_probe_breach == "fail")


def sync(
    trainer: WeightSource, rollouts: RolloutReplica | Sequence[RolloutReplica], config: SyncConfig | None = None
) -> SyncReport:
    """One-off sync. For repeated syncs keep a `Syncer`: it plans (and makes its collective group) once."""
    with Syncer(trainer, rollouts, config) as syncer:
        return syncer.sync()


def _merge_metadata(sources: list[tuple[str, Any]], metadata: list[list[TensorMeta]]) -> list[TensorMeta]:
    """The union of what the ranks hold (each may hold part of the names); the same name must agree everywhere."""
    merged: dict[str, tuple[str, TensorMeta]] = {}
    problems = []
    for (who, _), metas in zip(sources, metadata):
        for meta in checked_metadata(metas, who, aliases=False):  # the merged list's aliases: make_plan
            first = merged.setdefault(meta.name, (who, meta))
            if (first[1].shape, first[1].dtype) != (meta.shape, meta.dtype):
                problems.append(f"{meta.name}: {first[1].shape} {first[1].dtype} on {first[0]}, {meta.shape} {meta.dtype} on {who}")
    if problems:
        raise PlanMismatchError("the trainer's ranks disagree on tensors:\n  " + "\n  ".join(problems))
    return [meta for _, meta in merged.values()]
