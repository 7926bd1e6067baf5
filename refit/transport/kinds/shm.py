"""The `shm` transport: buckets in memory files of the trainer's, mapped by the workers of rollouts on its host.

Why no deltas: on one host the copy into the file is the whole wire, and a
delta costs the trainer a diff and each replica a rebuild that are about as
dear as that copy, besides a second copy of the model on each side as the
base. Only tables of contents and the files' places cross Ray and vLLM's
RPC, so any engine layout on the trainer's host is reached, except a `vllm
serve` server: it would open a file a network caller names
(refit/transport/shm.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from refit.transport.buckets import BucketContents, ReadersDone, WireBucket
from refit.transport.collective import BucketReceiver, CollectiveGroup, Rendezvous
from refit.transport.ipc import IpcTransport
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportTraits, deliver_to_workers
from refit.transport.shm import ShmHandle, forget_unused_mappings, open_shm_bucket, refuse_rewritten, shared_segments

__all__ = ["SharedMemoryTransport"]


class SharedMemoryTransport:
    name = "shm"
    traits = TransportTraits(maps_shared_memory=True, one_host=True, sender_methods=("transport_host",))

    def stream_handle(self, max_buckets_in_flight: int, form_group: Callable[[], Rendezvous]) -> StreamHandle:
        # A file is rewritten after as many newer buckets as a CUDA IPC bucket must outlive: the same window.
        return ShmHandle(IpcTransport.for_buckets_in_flight(max_buckets_in_flight).keep)

    def handles(self, handle: Any) -> bool:
        return isinstance(handle, ShmHandle)

    def bucket_buffers(self, handle: Any) -> Callable[[int], np.ndarray]:
        segments = shared_segments()
        return lambda nbytes: segments.reserve(nbytes, handle.keep)

    def send(self, buckets: Iterable[WireBucket], handle: Any,
             group: CollectiveGroup | None) -> Iterator[BucketContents | ReadersDone]:
        yield from shared_segments().send(buckets, handle.keep)
        # Enough to reach any relay's window (keep // 2 = max_buckets_in_flight + 1; two or more): the stream pauses
        # at them until its sync's replicas have loaded every bucket, so its files are not lent to the next stream
        # while they read them (`ReadersDone`).
        for _ in range(handle.keep // 2):
            yield ReadersDone()

    def deliver(self, bucket: Any, next_bucket_bytes: list[int | None] | None, sink: BucketSink, timeout_s: float) -> float:
        return deliver_to_workers(bucket, next_bucket_bytes, sink)

    def prepare_worker(self) -> None:
        forget_unused_mappings()

    def receive(self, parts: list[BucketContents], receivers: list[BucketReceiver], next_bucket_bytes: Sequence[int | None],
                device: torch.device) -> list[WireBucket]:
        return [open_shm_bucket(part) for part in parts]

    def loaded(self, parts: list[BucketContents]) -> None:
        for part in parts:
            refuse_rewritten(part)
