"""The `ipc` transport: CUDA IPC handles of the trainer's GPU memory, for a trainer and rollout on one GPU.

Why no deltas: trainer and rollout share the GPU, so there is no wire to
save, and a base would be a second copy of the model. Only the handles
cross Ray and vLLM's RPC, so any engine layout is reached, except a `vllm
serve` server: a handle opens another process's GPU memory, never from
the network (refit/transport/ipc.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import BucketReceiver, CollectiveGroup, Rendezvous
from refit.transport.ipc import IpcSender, IpcTransport, open_ipc_bucket, require_cuda
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportTraits, deliver_to_workers

__all__ = ["CudaIpcTransport"]


class CudaIpcTransport:
    name = "ipc"
    traits = TransportTraits(opens_ipc_handles=True)

    def stream_handle(self, max_buckets_in_flight: int, form_group: Callable[[], Rendezvous]) -> StreamHandle:
        return IpcTransport.for_buckets_in_flight(max_buckets_in_flight)

    def handles(self, handle: Any) -> bool:
        return isinstance(handle, IpcTransport)

    def bucket_buffers(self, handle: Any) -> None:
        return None

    def send(self, buckets: Iterable[WireBucket], handle: Any, group: CollectiveGroup | None) -> Iterator[BucketContents]:
        return IpcSender(keep=handle.keep).send(buckets)

    def deliver(self, bucket: Any, next_bucket_bytes: list[int | None] | None, sink: BucketSink, timeout_s: float) -> float:
        return deliver_to_workers(bucket, next_bucket_bytes, sink)

    def prepare_worker(self) -> None:
        require_cuda("this vLLM worker")

    def receive(self, parts: list[BucketContents], receivers: list[BucketReceiver], next_bucket_bytes: Sequence[int | None],
                device: torch.device) -> list[WireBucket]:
        return [open_ipc_bucket(part, device) for part in parts]

    def loaded(self, parts: list[BucketContents]) -> None:
        pass  # the trainer keeps a bucket's GPU memory alive for `keep` newer ones, unnumbered
