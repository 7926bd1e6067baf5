"""The `collective` transport: one broadcast per bucket from the trainer's ranks into every worker of every replica.

Why it reaches any engine layout: only a bucket's table of contents crosses
Ray and vLLM's RPC (or a server's HTTP), while the workers receive the bytes
in a torch.distributed group they joined (refit/transport/collective.py).
One group holds every member, so a member lost breaks every broadcast, and
one broadcast reaches every replica: all get the same kind of bucket. The
delta base lives in the workers, where the bytes arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from refit.errors import LifecycleError, TransportError
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import BucketReceiver, BucketSender, CollectiveGroup, Rendezvous, receive_parts
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportTraits, deliver_to_workers

__all__ = ["CollectiveTransport"]

GROUP_METHODS = ("join_transport", "leave_transport", "transport_group")  # what the driver calls on every member


class CollectiveTransport:
    name = "collective"
    traits = TransportTraits(delta_base_in="workers", reads_ahead=True, one_group=True, reaches_server=True,
                             sender_methods=GROUP_METHODS, replica_methods=(*GROUP_METHODS, "transport_ranks"))

    def stream_handle(self, max_buckets_in_flight: int, form_group: Callable[[], Rendezvous]) -> StreamHandle:
        return form_group()

    def handles(self, handle: Any) -> bool:
        return isinstance(handle, Rendezvous)

    def bucket_buffers(self, handle: Any) -> None:
        return None

    def send(self, buckets: Iterable[WireBucket], handle: Any, group: CollectiveGroup | None) -> Iterator[BucketContents]:
        """Broadcast each bucket in the group `handle` names, which the trainer joined first (`join_transport`)."""
        group_id = None if group is None else group.rendezvous.group_id
        if group_id != handle.group_id:
            raise TransportError(
                f"asked to send over collective group {handle.group_id}, but this trainer is in "
                f"{group_id or 'no group'}; the sync joins it first (join_transport). If it did, another Syncer (a "
                "second driver's, say) took the trainer into its own group since: a trainer is in one collective group "
                "at a time, so Syncers that share it over transport='collective' sync one at a time"
            )
        return BucketSender(group).send(buckets)

    def deliver(self, bucket: Any, next_bucket_bytes: list[int | None] | None, sink: BucketSink, timeout_s: float) -> float:
        return deliver_to_workers(bucket, next_bucket_bytes, sink)

    def prepare_worker(self) -> None:
        pass

    def receive(self, parts: list[BucketContents], receivers: list[BucketReceiver], next_bucket_bytes: Sequence[int | None],
                device: torch.device) -> list[WireBucket]:
        if not receivers:
            raise LifecycleError("a bucket's contents arrived, but this worker is in no collective group")
        return receive_parts(receivers, parts, list(next_bucket_bytes))

    def loaded(self, parts: list[BucketContents]) -> None:
        pass  # the broadcast wrote into the worker's own buffer
