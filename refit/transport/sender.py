"""A weight source's end of every transport, in one object a trainer process holds.

`actors.TrainerActor` (or any weight source) keeps one `TransportSender`,
exposes `join`/`leave`/`group_id` as `join_transport`/`leave_transport`/
`transport_group`, and passes its buckets through `send` in
`stream_buckets(plan, transport, delta)` (after `encode`). That keeps the protocol's knowledge of
transports here, not in each trainer. It also keeps the sender's delta base
(refit/transport/delta.py): `base_entries` is the trainer's `base_entries`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from refit.errors import TransportError
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import CollectiveGroup, Rendezvous
from refit.transport.delta import DeltaMode, SenderBase
from refit.transport.ipc import IpcTransport
from refit.transport.kinds import kind_of_handle
from refit.transport.shm import ShmHandle

__all__ = ["TransportSender"]


class TransportSender:
    def __init__(self) -> None:
        self._group: CollectiveGroup | None = None
        self._base = SenderBase()

    def join(self, rendezvous: Rendezvous, member: int) -> None:
        """Join a collective group as sending `member` (leaving any earlier group); blocks until every member has joined."""
        if member >= rendezvous.senders:
            raise TransportError(f"member {member} of group {rendezvous.group_id} is a worker; a trainer joins as a sender")
        self.leave()
        (self._group,) = CollectiveGroup.join(rendezvous, member)

    def leave(self, group_id: str | None = None) -> None:
        """Leave collective group `group_id` if in it; None: whichever group this sender is in."""
        if self._group is None or group_id not in (None, self._group.rendezvous.group_id):
            return
        group, self._group = self._group, None
        group.close()

    def group_id(self) -> str | None:
        return None if self._group is None else self._group.rendezvous.group_id

    def base_entries(self) -> list[tuple[str, int, str, tuple[int, ...], int]]:
        """What the last stream sent, entry by entry, for the version digest a delta is made against."""
        return self._base.entries()

    def encode(self, buckets: Iterable[WireBucket], delta: DeltaMode | str) -> Iterator[WireBucket]:
        """`delta` (the Syncer's choice): whole buckets, their deltas against the last stream's, or both;
        every whole bucket becomes the new base, except under "off", which leaves the base to the Syncers that
        send deltas (`SenderBase.stream`). A trainer times this with its own producing."""
        return self._base.stream(buckets, DeltaMode(delta))

    def bucket_buffers(self, transport: Rendezvous | IpcTransport | ShmHandle | str) -> Callable[[int], np.ndarray] | None:
        """Where the producer writes each bucket for `transport` (`refit.transport.buckets.buffers_from`); None: fresh
        host memory."""
        return kind_of_handle(transport).bucket_buffers(transport)

    def send(
        self, buckets: Iterable[WireBucket], transport: Rendezvous | IpcTransport | ShmHandle | str
    ) -> Iterable[WireBucket] | Iterator[BucketContents]:
        """The buckets as the stream carries them: whole (`"ray"`), or their contents while the bytes go another way."""
        return kind_of_handle(transport).send(buckets, transport, self._group)
