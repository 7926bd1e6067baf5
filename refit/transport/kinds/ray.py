"""The `ray` transport: whole buckets through Ray's object store, handed to vLLM's workers as RPC arguments.

Why it needs the engine core in the replica's process: the tensors cross
`collective_rpc` as arguments, which an engine core in another process
(AsyncLLM, VLLM_ENABLE_V1_MULTIPROCESSING=1, `vllm serve`) cannot pass on.
Each replica fetches the buckets it needs itself, so replicas may get whole
buckets and deltas side by side, and the delta base lives in the replica's
process, where buckets become tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from refit.errors import LifecycleError
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import BucketReceiver, CollectiveGroup, Rendezvous
from refit.transport.kinds.protocol import BucketSink, StreamHandle, TransportTraits
from refit.transport.object_store import fetch_parts

__all__ = ["RayTransport"]

_HANDLE = "ray"  # what the trainer's stream is told: no group, no handles, just the object store


class RayTransport:
    name = "ray"
    traits = TransportTraits(by_contents=False, delta_base_in="replica", needs_core_in_process=True)

    def stream_handle(self, max_buckets_in_flight: int, form_group: Callable[[], Rendezvous]) -> StreamHandle:
        return _HANDLE

    def handles(self, handle: Any) -> bool:
        return isinstance(handle, str) and handle == _HANDLE

    def bucket_buffers(self, handle: Any) -> None:
        return None

    def send(self, buckets: Iterable[WireBucket], handle: Any, group: CollectiveGroup | None) -> Iterable[WireBucket]:
        return buckets  # the stream's own objects are the object store's

    def deliver(self, bucket: Any, next_bucket_bytes: list[int | None] | None, sink: BucketSink, timeout_s: float) -> float:
        return sink.load_fetched(fetch_parts(bucket, timeout_s))

    def prepare_worker(self) -> None:
        pass

    def receive(self, parts: list[BucketContents], receivers: list[BucketReceiver], next_bucket_bytes: Sequence[int | None],
                device: torch.device) -> list[WireBucket]:
        raise LifecycleError("a bucket's contents arrived during a ray update, whose tensors cross vLLM's RPC; refused")

    def loaded(self, parts: list[BucketContents]) -> None:
        pass  # never asked: ray buckets come whole, not by contents
