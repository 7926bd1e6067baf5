"""Step 3 of a sync: hand each of the trainer's buckets to every replica as soon as it exists.

Why a window: the trainer runs at most `SyncConfig.max_buckets_in_flight`
buckets ahead of the slowest replica, so quantizing bucket i+1 overlaps
loading bucket i while memory stays bounded; every wait has a deadline.
Over `collective`, `ipc` and `shm` the trainer's stream carries only each
bucket's table of contents, which the driver reads; over `collective` it
looks one bucket ahead, so that a worker can post the receive of the next
bucket before it loads this one (the others hand each bucket on at once:
waiting for the next would keep the first from loading while the trainer
makes the second). Over `ray` each replica fetches the bucket's refs itself
(the driver never pulls bucket bytes), so a lost replica is dropped and
the others go on; over `collective` its loss breaks every member's
broadcasts (`GroupBroken`).
"""

from __future__ import annotations

import collections
from typing import Any

from refit.errors import PlanMismatchError
from refit.orchestration.calls import BucketStream, Outcome, submit_all, submitting_together, wait_all
from refit.orchestration.fleet import Roll, broken_group, losses
from refit.orchestration.progress import progress_bar
from refit.plan.config import SyncConfig
from refit.plan.transfer_plan import TransferPlan
from refit.transport.delta import DeltaMode
from refit.transport.kinds import StreamHandle, kind_of_handle

__all__ = ["BucketRelay"]


class BucketRelay:
    """One sync's stream, from the trainer's ranks to the roll's members: `open` starts the ranks' streams, `run`
    hands their buckets on and returns each member's load seconds."""

    def __init__(self, plan: TransferPlan, sync_id: str, roll: Roll, sources: list[tuple[str, Any]],
                 config: SyncConfig) -> None:
        self.plan, self.sync_id, self.roll = plan, sync_id, roll
        self.version = 0  # decided once every member began: `run`'s
        self.sources = sources
        self.config = config
        self.timeout = config.timeout_s
        self.in_flight: collections.deque[list[tuple[str, Any]]] = collections.deque()
        self.streams: list[BucketStream] = []
        self.transport: StreamHandle = "ray"
        self.delta: DeltaMode | None = None
        self.seconds: dict[str, float] = {}
        self.one_group = False  # every member's broadcasts break with one member
        self.progress: Any = None

    def open(self, transport: StreamHandle, delta: DeltaMode | None) -> None:
        """Start every trainer rank's stream: each makes its first buckets (up to the window) before `run` asks.

        Why apart from `run`: the Syncer opens the streams while the
        members other than the first claimed still begin, where no group
        must be formed first, so that the trainer's first bucket is made
        during that round rather than after it. `close` stops them.
        """
        self.transport, self.delta = transport, delta
        # A rank that fails yields its error, then joins the gathers its peers wait in (`RankSource.stream`): with a
        # window of one it would stop at that yield until the relay took the error, while the relay waited for a
        # peer's part in such a gather.
        window = self.config.max_buckets_in_flight if len(self.sources) == 1 else max(self.config.max_buckets_in_flight, 2)
        with submitting_together():  # the ranks' streams gather from each other: every rank runs them in one order
            self.streams = [BucketStream(source, self.plan, window, transport, who=who, delta=delta)
                            for who, source in self.sources]

    def close(self) -> None:
        """Stop every stream still running (a failed sync's, or one that was never run); idempotent."""
        for stream in self.streams:
            stream.close()

    def run(self, version: int, modes: dict[str, str]) -> dict[str, float]:
        """Stream every bucket of the plan, from the streams `open` started, to the members in their `modes`
        ("full" or "delta"); load seconds by name. The relay's owner `close`s the streams, whatever happened."""
        kind = kind_of_handle(self.transport)
        by_contents, ahead = kind.traits.by_contents, kind.traits.reads_ahead
        self.one_group = kind.traits.one_group
        self.version = version
        self.seconds = dict.fromkeys((who for who, _ in self.roll.members), 0.0)
        buckets, streams, delta = len(self.plan.buckets), self.streams, self.delta
        by_mode = {mode: [(who, r) for who, r in self.roll.members if modes.get(who, "full") == mode] for mode in ("full", "delta")}
        self.progress = progress_bar(self.config.progress, buckets, f"refit sync v{version}", unit="bucket")
        try:
            upcoming = [self._next(stream, fetch=True) for stream in streams] if ahead else []
            for index in range(buckets):
                if ahead:  # each rank's contents of this bucket, and of the one after
                    parts = upcoming
                    upcoming = [self._next(stream, fetch=True) for stream in streams] if index + 1 < buckets else []
                    delta_parts = parts
                elif by_contents:
                    parts = delta_parts = [self._next(stream, fetch=True) for stream in streams]
                else:
                    parts = [self._next(stream) for stream in streams]  # one part per rank (one rank: the bucket)
                    # In "both" mode each rank yields the whole part, then its delta.
                    delta_parts = [self._next(stream) for stream in streams] if delta is DeltaMode.BOTH else parts
                if any(part is None for part in parts + delta_parts):
                    raise self._ended_early(parts + delta_parts)
                self.in_flight.append(self._hand_on(by_mode, parts, delta_parts, upcoming, by_contents))
                while len(self.in_flight) >= self.config.max_buckets_in_flight:
                    self._wait_oldest()
            while self.in_flight:
                self._wait_oldest()
            # Every load is done: a stream that pauses at `ReadersDone` (shm) ends now; read, since only its
            # contents tell such an item from a bucket.
            extra = [who for (who, _), stream in zip(self.sources, streams)
                     if stream.next(self.timeout, fetch=by_contents) is not None]
            if extra:
                raise PlanMismatchError(f"{', '.join(extra)} streamed more buckets than the plan's {buckets}")
        finally:
            self.progress.close()
        return self.seconds

    def _next(self, stream: BucketStream, *, fetch: bool = False) -> Any:
        """`stream`'s next part; a load that fails meanwhile is raised (or its member dropped) at once.

        Why watch the loads: a trainer rank that fails hands its error on
        as a part, then still joins the gathers its peers wait in
        (`refit.sharding.RankSource.stream`); the peers make their parts
        only as fast as this relay takes them. Waiting for the failed
        rank's next part alone would hold every rank until the deadline;
        the members' loads of the error part fail at once.
        """
        watched = [ref for group in self.in_flight for who, ref in group if self.roll.has(who) and not isinstance(ref, Outcome)]
        return stream.next(self.timeout, fetch=fetch, watched=watched, on_finished=self._on_loads_finished)

    def _on_loads_finished(self, refs: list[Any]) -> None:
        """If any of these loads failed, settle every load in flight now: its error is raised, or its member dropped."""
        import ray

        try:
            ray.get(refs, timeout=self.timeout)
        except Exception:  # settled below, where each outcome is told apart
            while self.in_flight:
                self._wait_oldest()

    def _hand_on(self, by_mode: dict[str, list[tuple[str, Any]]], parts: list[Any], delta_parts: list[Any],
                 upcoming: list[Any], by_contents: bool) -> list[tuple[str, Any]]:
        """Submit one bucket's load to every member still in the roll, each the kind its mode asks; the pending loads."""
        submitted = []
        for members, sent in ((by_mode["full"], parts), (by_mode["delta"], delta_parts)):
            if by_contents:
                args = (sent, [None if part is None else part.nbytes for part in upcoming or [None] * len(sent)])
            else:
                args = (sent[0] if len(sent) == 1 else [ref for part in sent for ref in _as_list(part)],)
            submitted += submit_all([(who, r) for who, r in members if self.roll.has(who)], "load_bucket",
                                    self.sync_id, self.version, *args)
        return submitted

    def _wait_oldest(self) -> None:
        pending = [(who, ref) for who, ref in self.in_flight.popleft() if self.roll.has(who)]  # none for the dropped
        outcomes = wait_all(pending, "load_bucket", timeout_s=self.timeout, until_a_death=self.one_group)
        lost = losses(outcomes)
        if lost and self.one_group:
            raise broken_group(lost)
        for who, spent in self.roll.settle(outcomes, self.sync_id).items():
            self.seconds[who] += spent
        self.progress.update()

    def _ended_early(self, parts: list[Any]) -> PlanMismatchError:
        while self.in_flight:  # a trainer that failed ended its stream: the loads raise its error first
            self._wait_oldest()
        ended = sorted({who for (who, _), part in zip(self.sources * 2, parts) if part is None})
        return PlanMismatchError(f"{', '.join(ended)} ended the stream before the plan's {len(self.plan.buckets)} buckets")


def _as_list(part: Any) -> list[Any]:
    return part if isinstance(part, list) else [part]
