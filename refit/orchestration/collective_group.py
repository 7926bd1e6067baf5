"""The collective group's lifecycle, over `transport='collective'`: made once, kept, made again, broken, begun again.

Why it is kept between syncs: forming a group (a rendezvous, every worker
of every replica joining, a channel per sending rank) costs far more than
a sync's begin, so a Syncer makes it on its first collective sync and
reuses it. It is made again when the fleet changed, when a member is no
longer in it (a replica restarted, or joined another Syncer's group) or
after a failed sync, since a broadcast may have left it half-posted.

Why a broken group is its own failure: one member lost mid-broadcast
breaks every member's broadcasts, so the driver cannot go on without it as
over `ray`. The loss reaches the driver as a missed deadline or as one of
its echoes; the survivors' updates are then aborted and they begin again,
within the same `sync()`, in a new group without it.
"""

from __future__ import annotations

import logging
from typing import Any

from refit.errors import GroupBroken
from refit.orchestration.calls import (
    Outcome,
    call_all,
    call_groups,
    dead_members,
    raise_first_error,
    submit_all,
    submitting_together,
    summary,
    wait_all,
)
from refit.orchestration.fleet import Lost, Roll, broken_group, losses
from refit.plan.config import SyncConfig
from refit.protocols import accepts
from refit.transport.collective import JOIN_MARGIN_S, Rendezvous, RendezvousHost
from refit.transport.kinds import StreamHandle

__all__ = ["CollectiveGroupLifecycle"]

log = logging.getLogger("refit.orchestration")


class CollectiveGroupLifecycle:
    """The group's rendezvous, held while the group lives, and the replicas whose workers are in it."""

    def __init__(self, sources: list[tuple[str, Any]], config: SyncConfig) -> None:
        self.sources = sources
        self.config = config
        self._host: RendezvousHost | None = None
        self._replicas: tuple[str, ...] = ()

    def connect(self, sync_id: str, members: list[tuple[str, Any]]) -> StreamHandle:
        """What the trainer's stream is told to send over: "ray", an `IpcTransport`, a `ShmHandle`, or the collective group's rendezvous."""
        return self.config.transport_kind.stream_handle(self.config.max_buckets_in_flight,
                                                        lambda: self._group_for(sync_id, members))

    def _group_for(self, sync_id: str, members: list[tuple[str, Any]]) -> Rendezvous:
        """The group kept from an earlier sync if every member is still in it, else a new one.

        The group is the sending trainer ranks, then every worker of every
        replica of this sync; a channel per sending rank.
        """
        timeout = self.config.timeout_s
        if self._host is not None:
            same_fleet = self._replicas == tuple(who for who, _ in members)
            groups = self.answers(call_all(self.sources + members, "transport_group", timeout_s=timeout)) if same_fleet else []
            if same_fleet and all(g == self._host.rendezvous.group_id for g in groups):
                return self._host.rendezvous
            log.info("collective group %s: %s; making a new one", self._host.rendezvous.group_id,
                     "a member left it" if same_fleet else "the fleet changed")
            self.disconnect(members)
        return self._form(sync_id, members)

    def _form(self, sync_id: str, members: list[tuple[str, Any]]) -> Rendezvous:
        """A new group of the trainer's ranks and every worker of `members`; every member has joined when it returns."""
        timeout = self.config.timeout_s
        ranks = self.answers(call_all(members, "transport_ranks", timeout_s=timeout))
        senders = [who for who, _ in self.sources]
        names = senders + [f"{who} worker {w}" for (who, _), n in zip(members, ranks) for w in range(n)]
        self._host = RendezvousHost(names, timeout, senders=len(senders))
        self._replicas = tuple(who for who, _ in members)
        rendezvous = self._host.rendezvous
        offsets = [len(senders) + sum(ranks[:i]) for i in range(len(ranks))]
        pending = []
        with submitting_together():  # each join waits for the others: one order on every rank (a rival sync's group)
            for member, source in enumerate(self.sources):
                pending += submit_all([source], "join_transport", rendezvous, member)
            for replica, offset in zip(members, offsets):
                pending += submit_all([replica], "join_transport", rendezvous, offset, sync_id)
        # Members give up on a missing one at the deadline and name it: wait longer for that answer, relayed or not
        # (JOIN_MARGIN_S), unless a member is gone: then the others are told at once (`abandon`), not left to wait it out.
        try:
            self.answers(wait_all(pending, "join_transport", timeout_s=timeout + 2 * JOIN_MARGIN_S, until_a_death=True))
        except BaseException as error:
            self._host.abandon(f"{summary(error)}; the sync begins again or fails")
            # The members leave it in `begin_again` or `failures.failed`, once the roll has dropped those lost: a hung one,
            # asked here, would hold the sync for another `timeout_s` (a hung `vllm serve` cost two deadlines, not one).
            raise
        log.info("collective group %s: %d members (%s)", rendezvous.group_id, len(names), ", ".join(names))
        return rendezvous

    def answers(self, outcomes: list[Outcome]) -> list[Any]:
        """The answers to a call that checks or forms the collective group; a replica lost meanwhile raises `GroupBroken`.

        Why not the first error: a replica lost while the group forms (its
        actor dead, its `vllm serve` server gone while the actor lives, or
        silent) fails the others' joins as an echo, and its actor may still
        answer Ray. Acting on the loss lets the survivors begin again without
        it, as a loss mid-broadcast does. A trainer rank lost is no replica's
        loss: the replicas' missing answers are its echo.
        """
        senders = dict(self.sources)
        lost = losses(outcomes)
        if not lost:
            return raise_first_error(outcomes)
        broken = broken_group(lost)  # after a death, the others' missing answers (a trainer's too) are its echo
        if any(who in senders for who, _, _ in broken.lost):  # a trainer rank lost fails the sync, by name
            return raise_first_error(outcomes)
        raise broken

    def disconnect(self, members: list[tuple[str, Any]]) -> None:
        """The trainer ranks and `members` leave the group (bounded, best effort: a dead member has left already).

        Only this group: a member that has joined another Syncer's group since (whose sync may be streaming: this
        one may have failed because that one holds the replicas) stays in it. A member whose `leave_transport` does
        not take the group's id leaves whatever group it is in.
        """
        host, self._host, self._replicas = self._host, None, ()
        if host is None:
            return
        group_id = host.rendezvous.group_id
        scoped: list[tuple[str, Any]] = []
        unscoped: list[tuple[str, Any]] = []
        for target in self.sources + members:
            (scoped if _takes_group_id(target[1]) else unscoped).append(target)
        answers = call_groups([(scoped, "leave_transport", (group_id,)), (unscoped, "leave_transport", ())],
                              timeout_s=self.config.timeout_s)  # leaves wait for no one: no common order needed
        for outcome in (outcome for outcomes in answers for outcome in outcomes):
            if not outcome.ok:
                log.warning("%s could not leave collective group %s: %s", outcome.who, group_id, summary(outcome.error))
        host.close()

    def lost_with_it(self, error: Exception, roll: Roll) -> list[Lost]:
        """Over `collective`, the replicas whose loss broke the group (so the survivors may begin again); else none.

        A broken group reaches the driver as a missed deadline on the lost
        member (`GroupBroken`) or, often first, as its echoes: the trainer's
        failed broadcast, a survivor's failed receive, a join that timed out.
        Members are then asked whether they live; a dead trainer rank, or no
        dead replica, leaves the error a failure of the sync.
        """
        if not self.config.transport_kind.traits.one_group or roll.stage not in ("connect", "stream"):
            return []
        if isinstance(error, GroupBroken):
            return error.lost
        dead = dead_members(self.sources + roll.members, grace_s=min(3.0, self.config.timeout_s))
        if not dead or any(d.who in dict(self.sources) for d in dead):
            return []
        return [(d.who, "died", d) for d in dead]

    def begin_again(self, sync_id: str, roll: Roll, error: BaseException, why: str) -> None:
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
        self.disconnect(roll.members)


def _takes_group_id(member: Any) -> bool:
    """Whether `member.leave_transport` takes the group's id; a member whose method cannot be read is left to the
    call itself, which reports it (a clean-up never raises for one member)."""
    try:
        return accepts(member, "leave_transport", "group_id")
    except (AttributeError, TypeError, ValueError):
        return False
