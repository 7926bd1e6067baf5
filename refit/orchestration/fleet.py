"""Who takes part in one sync, and who was dropped from it.

A `Syncer` names each replica `rollout <id>`, the id given when it joined
and never reused, so a name in an error, a log line or a report means one
replica whatever joined or left since. One sync starts with every member
(`Roll`) and goes on without those it loses: a replica that died, or did
not answer a call within `SyncConfig.timeout_s`. Only those two drop a
member. A replica that answered with an error (a refused plan, a failed
check) fails the sync as before: dropping it would hide a bug and leave a
replica refusing that the report calls healthy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit.errors import GroupBroken
from refit.orchestration.calls import Outcome, loss, raise_first_error, submit_all, summary
from refit.orchestration.report import DroppedReplica

__all__ = ["Lost", "Roll", "broken_group", "losses", "replica_id", "replica_name"]

log = logging.getLogger("refit.orchestration")

Lost = tuple[str, str, BaseException]
"""A lost member: its name, how it was lost ("died" or "missed the deadline"), and the error that said so."""


def losses(outcomes: Sequence[Outcome]) -> list[Lost]:
    """The members that `outcomes` show lost, in their order (an answer or another error is no loss)."""
    return [(o.who, how, o.error) for o in outcomes if (how := loss(o))]


def replica_name(replica_id: int) -> str:
    return f"rollout {replica_id}"


def replica_id(name: str) -> int:
    return int(name.removeprefix("rollout "))


def broken_group(lost: list[Lost]) -> GroupBroken:
    """The group broken by `lost`, keeping only the dead if any died: the others' missing answers are
    then its echo (they wait on the group it broke), not losses of their own."""
    return GroupBroken([item for item in lost if item[1] == "died"] or lost)


class Roll:
    """The members still in one sync (name, handle), in the Syncer's order, and those dropped from it."""

    def __init__(self, members: Sequence[tuple[str, Any]], min_replicas: int) -> None:
        self.members = list(members)
        self._size = len(self.members)
        self.min_replicas = min_replicas
        self.dropped: list[DroppedReplica] = []
        self.stage = "begin"  # where a loss found now happened, for the report
        self._errors: list[BaseException] = []  # each drop's error, in order: the first one that breaks quorum is raised

    def has(self, who: str) -> bool:
        return any(name == who for name, _ in self.members)

    def settle(self, outcomes: Sequence[Outcome], sync_id: str) -> dict[str, Any]:
        """Each member's answer, by name; lost members are dropped, then any other error is raised, then the quorum checked."""
        lost = losses(outcomes)
        self.drop(lost, sync_id)
        answered = [o for o in outcomes if loss(o) is None]
        values = raise_first_error(answered)
        self.check_quorum()
        return {o.who: value for o, value in zip(answered, values)}

    def drop(self, lost: Sequence[Lost], sync_id: str) -> None:
        """Go on without `lost`. One that missed the deadline is sent an abort nobody waits for.

        Why not waited for: it is hung or busy, so the abort would cost another
        deadline; queued behind its late call, it closes the update that call
        may still open, and the replica's lease closes it otherwise.
        """
        for who, how, error in lost:
            if not self.has(who):
                continue
            handle = next(h for name, h in self.members if name == who)
            self.members = [(name, h) for name, h in self.members if name != who]
            self.dropped.append(DroppedReplica(replica_id(who), self.stage, how, summary(error)))
            self._errors.append(error)
            log.warning("sync %s: dropped %s, which %s at %s (%s); %d replica(s) go on",
                        sync_id, who, how, self.stage, summary(error), len(self.members))
            if how != "died":
                submit_all([(who, handle)], "abort_update", sync_id, f"sync {sync_id} dropped it: {summary(error)}")

    def check_quorum(self) -> None:
        """Raise the loss that left fewer than `SyncConfig.min_replicas` members, naming every drop."""
        if len(self.members) >= self.min_replicas or not self._errors:
            return
        cause = self._errors[min(max(self._size - self.min_replicas, 0), len(self._errors) - 1)]  # the drop one too many
        cause.add_note(
            f"only {len(self.members)} replica(s) remain, fewer than SyncConfig.min_replicas={self.min_replicas}, "
            f"so the sync fails; dropped: {'; '.join(map(str, self.dropped))}"
        )
        raise cause
