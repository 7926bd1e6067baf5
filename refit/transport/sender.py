"""A weight source's end of every transport, in one object a trainer process holds.

`actors.TrainerActor` (or any weight source) keeps one `TransportSender`,
exposes `join`/`leave`/`group_id` as `join_transport`/`leave_transport`/
`transport_group`, and passes its buckets through `send` in
`stream_buckets(plan, transport)`. That keeps the protocol's knowledge of
transports here, not in each trainer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from refit.errors import TransportError
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import BucketSender, CollectiveGroup, Rendezvous
from refit.transport.ipc import IpcSender

__all__ = ["TransportSender"]

# Buckets whose GPU memory an ipc sender keeps alive: the Syncer's default
# bound on buckets in flight plus the one being loaded and the next.
_IPC_KEEP = 4


class TransportSender:
    def __init__(self) -> None:
        self._group: CollectiveGroup | None = None

    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join a collective group (leaving any earlier one); blocks until every member has joined."""
        self.leave()
        self._group = CollectiveGroup.join(rendezvous, rank)

    def leave(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def group_id(self) -> str | None:
        return None if self._group is None else self._group.rendezvous.group_id

    def send(self, buckets: Iterable[WireBucket], transport: Rendezvous | str) -> Iterable[WireBucket] | Iterator[BucketContents]:
        """The buckets as the stream carries them: whole (`"ray"`), or their contents while the bytes go another way."""
        if transport == "ray":
            return buckets
        if transport == "ipc":
            return IpcSender(keep=_IPC_KEEP).send(buckets)
        if not isinstance(transport, Rendezvous):
            raise TransportError(f"transport={transport!r}: expected 'ray', 'ipc' or a collective group's Rendezvous")
        if self.group_id() != transport.group_id:
            raise TransportError(
                f"asked to send over collective group {transport.group_id}, but this trainer is in "
                f"{self.group_id() or 'no group'}; the sync joins it first (join_transport)"
            )
        return BucketSender(self._group).send(buckets)
