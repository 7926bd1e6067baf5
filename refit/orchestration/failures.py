"""What a failed sync raises, and what it leaves behind: failure attribution and cleanup.

Why attribution: when a member dies, its death reaches the driver in many
forms, and seldom first as itself: a broken gloo pair, a lost object, a
missed deadline on another member. Raising whichever arrived first would
send the user after an echo. So the members are asked whether they live,
and a dead one's death is raised, the echoes attached as notes, together
with what each replica was left doing (a replica that received nothing
keeps serving its old version, one that did refuses until a later sync
completes). A failed sync drops nobody: the fleet is left as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from refit.errors import ActorDiedError, VerificationError
from refit.orchestration.calls import call_all, dead_members, summary
from refit.orchestration.fleet import Roll, replica_name
from refit.orchestration.metrics import record_failure
from refit.plan.config import SyncConfig

__all__ = ["abort", "failed", "named_cause"]

log = logging.getLogger("refit.orchestration")


def failed(sync_id: str, error: BaseException, roll: Roll, sources: list[tuple[str, Any]], config: SyncConfig,
           leave_group: Callable[[list[tuple[str, Any]]], None]) -> BaseException:
    """Clean up after a failed sync; returns what to raise: `error`, or the death it echoes.

    Every remaining member's update is closed, and the members leave the
    collective group (`leave_group`), which a broadcast may have left
    half-posted (the next sync makes a new one). Members are asked whether
    they live first, so the error names a dead member whichever of its
    symptoms reached the driver first.
    """
    cause = error
    if isinstance(error, Exception):  # an interrupt is its own cause
        cause = named_cause(error, dead_members(sources + roll.members, grace_s=min(3.0, config.timeout_s)))
    abort(sync_id, cause, roll.members, config.timeout_s)
    for dropped in roll.dropped:
        cause.add_note(f"{replica_name(dropped.replica)}: lost ({dropped.cause} at {dropped.stage}); still a member of the Syncer")
    leave_group(roll.members)
    log.warning("sync %s failed: %s\n  %s", sync_id, summary(cause), "\n  ".join(getattr(cause, "__notes__", [])))
    record_failure(verification_failed=isinstance(cause, VerificationError), syncer=config.metrics_tag)
    return cause


def abort(sync_id: str, error: BaseException, members: list[tuple[str, Any]], timeout_s: float) -> None:
    """Close the update on every member (bounded); attach what each was left doing to `error`."""
    reason = f"sync {sync_id} failed: {summary(error)}"
    outcomes = call_all(members, "abort_update", sync_id, reason, timeout_s=timeout_s)
    for outcome in outcomes:
        state = outcome.value if outcome.ok else f"could not be reached to abort ({outcome.error!r})"
        error.add_note(f"{outcome.who}: {state}")


def named_cause(error: Exception, dead: list[ActorDiedError]) -> Exception:
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
