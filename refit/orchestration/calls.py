"""Remote calls with deadlines, on Ray actor handles or plain objects.

`Syncer` talks to its trainer and replicas only through this module, so
that every wait has a deadline and every failure arrives as an outcome
naming who failed, and so that the same flow runs on plain Python objects
(a single process, or the fast test tier) without Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from refit.errors import ActorDiedError, EngineGoneError, EngineHungError, SyncTimeoutError, TransportError
from refit.transport.buckets import ReadersDone
from refit.transport.kinds import kind_of_handle
from refit.transport.object_store import remote_error

__all__ = [
    "BucketStream",
    "Outcome",
    "call_all",
    "call_groups",
    "dead_members",
    "first_claim",
    "is_actor",
    "loss",
    "raise_first_error",
    "submit_all",
    "submitting_together",
    "summary",
    "wait_all",
    "wait_until_started",
]

log = logging.getLogger("refit.orchestration")


def is_actor(target: Any) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # a single-process setup without Ray
        return False
    return isinstance(target, ActorHandle)


def first_claim(targets: Sequence[tuple[str, Any]]) -> tuple[str, Any]:
    """The target every driver claims first: the lowest Ray actor id (a plain object only after every actor).

    Why: two syncs started at once on the same replicas that each claim all
    of them at once can each win some and both be refused. Claiming this one
    alone, before the others, leaves one winner: the loser is refused here
    and never touches another replica.
    """
    return min(targets, key=lambda t: (0, t[1]._actor_id.hex()) if is_actor(t[1]) else (1, f"{id(t[1]):016x}"))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one remote call came to: a value or an error."""

    who: str
    value: Any = None
    error: BaseException | None = None
    unanswered: bool = False  # no answer within the deadline (the call may still be running)

    @property
    def ok(self) -> bool:
        return self.error is None


def loss(outcome: Outcome) -> str | None:
    """How the call's target itself was lost, if it was: "died" or "missed the deadline"; None otherwise.

    Why only these two: a fleet drops a member that is gone or stopped
    answering, and never one that answered with an error (a refused plan, a
    failed check), which would be a bug to hide. A death the target relays
    about another actor (a replica whose fetch found the trainer dead) is
    that actor's, not the target's, and is no loss of the target. A
    replica whose engine is gone while its actor lives (`EngineGoneError`: a
    `vllm serve` server that died or restarted) has died as a replica; one
    whose engine missed the deadline (`EngineHungError`: a hung server) has
    missed it as a replica, whichever of its own deadline and the driver's
    came first.
    """
    if isinstance(outcome.error, ActorDiedError) and outcome.error.who == outcome.who:
        return "died"
    if isinstance(outcome.error, EngineGoneError):  # `_resolve` made Ray's wrapper an instance of the remote error's class
        return "died"
    if outcome.unanswered or isinstance(outcome.error, EngineHungError):
        return "missed the deadline"
    return None


_SUBMITTING = threading.RLock()


@contextmanager
def submitting_together() -> Iterator[None]:
    """Hold while submitting one call to each of several actors whose calls wait for one another (a sharded trainer's
    ranks: their streams gather rows from each other, their group joins meet).

    Why: Ray runs one caller's calls to an actor in the order it submitted them. Two syncs of this process (two
    Syncers on one trainer, in two threads) that each submit such a set whole, one set before the other, have every
    rank run them in the same order. Interleaved, rank 0 could start sync A's stream and rank 1 sync B's, each then
    waiting in a gather for the other until the deadline, which also breaks the trainer's process group.
    """
    with _SUBMITTING:
        yield


def submit_all(targets: Sequence[tuple[str, Any]], method: str, *args: Any) -> list[tuple[str, Any]]:
    """Start `method(*args)` on every `(name, target)`: on actors all at once, before another thread's set
    (`submitting_together`); plain objects run it now, outside the lock (they have no queue to order)."""
    with submitting_together():
        started = {i: getattr(target, method).remote(*args) for i, (_, target) in enumerate(targets) if is_actor(target)}
    return [(who, started[i] if i in started else _call_inline(who, target, method, args))
            for i, (who, target) in enumerate(targets)]


def wait_all(
    pending: Sequence[tuple[str, Any]], method: str, *, timeout_s: float, until_a_death: bool = False
) -> list[Outcome]:
    """Wait at most `timeout_s` for every submitted call.

    Never raises for a failed call: each outcome carries its value or error
    (a dead actor, an exception in the call, a missed deadline).
    `until_a_death`: stop as soon as one target has died, when its death
    breaks what the others wait for (a collective group's broadcast); calls
    still running then come back unanswered.
    """
    refs = [ref for _, ref in pending if not isinstance(ref, Outcome)]
    if refs:
        import ray

        if until_a_death:
            _wait_until_a_death([(who, ref) for who, ref in pending if not isinstance(ref, Outcome)], method, timeout_s)
        else:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return _outcomes(pending, method, timeout_s)


def _outcomes(pending: Sequence[tuple[str, Any]], method: str, timeout_s: float) -> list[Outcome]:
    """Each call's outcome as it stands now (one still running: unanswered within `timeout_s`)."""
    return [ref if isinstance(ref, Outcome) else _resolve(who, method, ref, timeout_s) for who, ref in pending]


def _wait_until_a_death(pending: list[tuple[str, Any]], method: str, timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    waiting = {ref: who for who, ref in pending}
    while waiting and (remaining := deadline - time.monotonic()) > 0:
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=remaining)
        for ref in ready:
            who = waiting.pop(ref)
            if loss(_resolve(who, method, ref, timeout_s)) == "died":
                return


def call_all(targets: Sequence[tuple[str, Any]], method: str, *args: Any, timeout_s: float) -> list[Outcome]:
    """`submit_all` then `wait_all`."""
    return wait_all(submit_all(targets, method, *args), method, timeout_s=timeout_s)


def call_groups(groups: Sequence[tuple[Sequence[tuple[str, Any]], str, tuple]], *, timeout_s: float) -> list[list[Outcome]]:
    """Several `call_all`s, `(targets, method, args)` each, in one round: every call is sent before any is waited for,
    so the questions a sync asks between its steps cost one round trip, not one each."""
    pending = [(submit_all(targets, method, *args), method) for targets, method, args in groups]
    refs = [ref for calls, _ in pending for _, ref in calls if not isinstance(ref, Outcome)]
    if refs:  # one deadline for the round: a hung member in each group must not make it two
        import ray

        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return [_outcomes(calls, method, timeout_s) for calls, method in pending]


def raise_first_error(outcomes: Sequence[Outcome]) -> list[Any]:
    """The values, or the first error, with a note naming the member that raised it (of several) and one for every
    other failed outcome.

    A `TransportError` comes last: a broken collective group is usually the
    echo of another member's failure (a replica that died), which names the cause.
    """
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: isinstance(o.error, TransportError))
    if failed:
        error = failed[0].error
        if len(outcomes) > 1:  # which of the fleet refused, where its message cannot say
            error.add_note(f"raised by {failed[0].who}")
        for other in failed[1:]:
            error.add_note(f"also: {other.who}: {summary(other.error)}")
        raise error
    return [o.value for o in outcomes]


def summary(error: BaseException) -> str:
    """`Type: first line of the message`, of the original error behind Ray's wrapper."""
    cause = getattr(error, "cause", None) or error  # RayTaskError keeps the remote exception as `cause`
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__  # a KeyboardInterrupt says nothing


_OPEN_STREAMS: dict[bytes, int] = {}  # trainer actor id -> this process's streams from it not yet ended
_OPEN_STREAMS_LOCK = threading.Lock()


class BucketStream:
    """The trainer's stream of buckets for one sync: each next bucket within a deadline, closed on every exit.

    Open streams are counted per trainer actor in this process, so that a deadline missed while another of this
    process's syncs streams from the same actor says so: an actor runs one call at a time unless it is threaded, and
    the second stream waits behind the first, which reads as a hung trainer otherwise.
    """

    def __init__(
        self, trainer: Any, plan: Any, max_in_flight: int, transport: Any = "ray", *, who: str = "the trainer",
        delta: str | None = None,
    ) -> None:
        """`delta`: the `DeltaMode` of a source that keeps a base (None for one that does not); in "both"
        mode it yields two items per bucket, the whole one then its delta."""
        self._actor = is_actor(trainer)
        self._who = who  # "the trainer", or "trainer rank i" of a sharded one
        # A custom source may know only the object store, and only whole buckets.
        args = (plan,) if not kind_of_handle(transport).traits.by_contents and delta is None else (plan, transport)
        args += () if delta is None else (str(delta),)
        self._actor_id: bytes | None = trainer._actor_id.binary() if self._actor else None
        if self._actor:
            with _OPEN_STREAMS_LOCK:
                _OPEN_STREAMS[self._actor_id] = _OPEN_STREAMS.get(self._actor_id, 0) + 1
            self._gen = trainer.stream_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=max_in_flight * (2 if delta == "both" else 1)
            ).remote(*args)
        else:
            self._gen = iter(trainer.stream_buckets(*args))
        self._done = False

    def next(self, timeout_s: float, *, fetch: bool = False, watched: Sequence[Any] = (),
             on_finished: Callable[[list[Any]], None] | None = None) -> Any | None:
        """The next bucket, or None at the end of the stream; `on_finished` gets each ref of `watched` that finishes
        first (and may raise).

        From an actor the bucket is a one-element list holding its object ref:
        a nested ref is not fetched by the driver (which would pull every
        bucket through its node) but by each replica. A failure inside the
        trainer is stored in that object and raised by the replica's fetch.
        `fetch`: the driver reads it itself (a bucket's contents, a few KB,
        when the bytes travel over another transport).
        """
        if not self._actor:
            bucket = next((item for item in self._gen if not isinstance(item, ReadersDone)), None)
            self._done = bucket is None
            return bucket
        while True:  # a sender's `ReadersDone` items: taken (its readers are done when the consumer asks), then passed
            item = self._next_item(timeout_s, fetch=fetch, watched=watched, on_finished=on_finished)
            if not isinstance(item, ReadersDone):
                return item
            watched = ()

    def _next_item(self, timeout_s: float, *, fetch: bool, watched: Sequence[Any],
                   on_finished: Callable[[list[Any]], None] | None) -> Any | None:
        import ray

        deadline = time.monotonic() + timeout_s
        watched = list(watched) if on_finished is not None else []
        while True:
            ready, _ = ray.wait([self._gen, *watched], num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready or any(item is self._gen for item in ready):
                break
            watched = [ref for ref in watched if ref not in ready]
            on_finished(ready)
            deadline = time.monotonic() + timeout_s  # what `on_finished` waited for is not the stream's time
        if not any(item is self._gen for item in ready):
            with _OPEN_STREAMS_LOCK:
                others = _OPEN_STREAMS.get(self._actor_id, 1) - 1
            why = (f"another sync of this process is streaming from the same actor ({others} more stream(s) open), "
                   "and an actor that is not threaded runs one stream at a time, so this one waits behind it: sync "
                   "one at a time per trainer, or raise the deadline" if others else
                   "it is hung, overloaded or its preflight is slower than the deadline")
            raise SyncTimeoutError(f"{self._who} produced no bucket within {timeout_s:.0f} s (SyncConfig.timeout_s); {why}")
        try:
            ref = next(self._gen)
        except StopIteration:
            self._end()
            return None
        if not fetch:
            return [ref]
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise SyncTimeoutError(f"the bucket contents of {self._who} did not arrive within {timeout_s:.0f} s") from None
        except Exception as error:  # the trainer raised while producing it
            raise remote_error(error, self._who, "stream_buckets") from None

    def close(self) -> None:
        """Stop the trainer's generator (its `finally` runs) unless it already ended."""
        if self._done:
            return
        self._end()
        if self._actor:
            import ray

            ray.cancel(self._gen)
        else:
            close = getattr(self._gen, "close", None)
            if close is not None:
                close()

    def _end(self) -> None:
        self._done = True
        if self._actor_id is not None:
            with _OPEN_STREAMS_LOCK:
                left = _OPEN_STREAMS.pop(self._actor_id) - 1
                if left:
                    _OPEN_STREAMS[self._actor_id] = left
            self._actor_id = None


def _call_inline(who: str, target: Any, method: str, args: tuple) -> Outcome:
    try:
        return Outcome(who, getattr(target, method)(*args))
    except Exception as error:  # a KeyboardInterrupt still propagates
        return Outcome(who, error=error)


def _resolve(who: str, method: str, ref: Any, timeout_s: float) -> Outcome:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        # Left to finish or fail on its own: a late answer to a sync that gave
        # up is refused by the replica's lifecycle (the update is closed).
        return Outcome(who, error=SyncTimeoutError(
            f"{who}: {method} did not answer within {timeout_s:.0f} s (SyncConfig.timeout_s); "
            "the actor is hung, overloaded or waiting for long requests"
        ), unanswered=True)
    try:
        return Outcome(who, ray.get(ref))
    except Exception as error:
        return Outcome(who, error=remote_error(error, who, method))


def wait_until_started(
    targets: Sequence[tuple[str, Any]], *, timeout_s: float, on_started: Callable[[], None] | None = None
) -> float:
    """Wait until every actor among `targets` has finished its constructor; returns the seconds waited.

    Why a wait of its own: a constructor loads a model or starts an engine
    (minutes on a GPU: weights, torch.compile, CUDA graphs), and Ray queues
    every call behind it. Counting that against `SyncConfig.timeout_s` would
    fail a healthy first sync, so the start-up has its own deadline and the
    sync's deadlines start once every actor is up. An actor whose
    constructor fails ends the wait at once, named, with its own error.
    `on_started()` is called once for each actor that is up.
    """
    import ray

    start = time.monotonic()
    waiting = {target.__ray_ready__.remote(): who for who, target in targets if is_actor(target)}
    announced = False
    while waiting:
        remaining = start + timeout_s - time.monotonic()
        if remaining <= 0:
            raise SyncTimeoutError(
                f"{', '.join(waiting.values())} did not finish starting within {timeout_s:.0f} s "
                "(SyncConfig.startup_timeout_s); their constructors are still running or are hung"
            )
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=remaining if announced else min(remaining, 1.0))
        if not ready and not announced:
            log.info("waiting for %s to start (up to %.0f s, SyncConfig.startup_timeout_s)", ", ".join(waiting.values()), timeout_s)
            announced = True
        for ref in ready:
            who = waiting.pop(ref)
            try:
                ray.get(ref)
            except Exception as error:
                raise remote_error(error, who, "starting") from None
            if on_started is not None:
                on_started()
    return time.monotonic() - start


def dead_members(targets: Sequence[tuple[str, Any]], *, grace_s: float) -> list[ActorDiedError]:
    """Which actors among `targets` are dead, each as the error that names it; waits at most `grace_s`.

    Why: when one member of a sync dies, the others' symptoms (a broken
    gloo/NCCL pair, a lost object, a missed deadline) often reach the driver
    before the death does. Asking every actor for a trivial answer (Ray's
    `__ray_ready__`, which no update or request holds up) tells the dead from
    the merely failed, whatever arrived first. An actor that does not answer
    in time counts as alive.
    """
    outcomes = call_all([(who, target) for who, target in targets if is_actor(target)], "__ray_ready__", timeout_s=grace_s)
    return [o.error for o in outcomes if isinstance(o.error, ActorDiedError)]
