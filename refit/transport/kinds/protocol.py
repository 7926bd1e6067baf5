"""What each transport means to the rest of refit: one object, `TransportKind`, with a driver, a sender and a receiver half.

Why one object: each transport used to be a set of branches on its name in a
dozen files, so adding one meant editing all of them. Each one is now
a small class in a module of its own (`ray.py`, `collective.py`, `ipc.py`, `shm.py`),
registered by name in `refit.transport.kinds` (the only place that knows the
names), and the driver, the trainer's sender, the replica and its workers
ask it, never its name. Like vLLM's `distributed/weight_transfer/` backends.

This package sits with the transport's building blocks, below the plan,
the engine and the driver: what a half needs from those layers comes in as
an argument (`form_group`, a `BucketSink`), never as an import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import BucketReceiver, CollectiveGroup, Rendezvous
from refit.transport.ipc import IpcTransport
from refit.transport.shm import ShmHandle

__all__ = ["BucketSink", "StreamHandle", "TransportKind", "TransportTraits", "deliver_to_workers"]

StreamHandle = Rendezvous | IpcTransport | ShmHandle | str
"""What the trainer's stream is told to send over: "ray", a collective group's `Rendezvous`, an `IpcTransport` or a
`ShmHandle`."""


class BucketSink(Protocol):
    """A replica's two ways of loading one bucket; its transport's `deliver` picks one. Each returns seconds spent loading."""

    def load_fetched(self, parts: list[WireBucket]) -> float:
        """Load the bucket's parts, fetched whole into the replica's process."""
        ...

    def receive_in_workers(self, contents: list[BucketContents], next_bucket_bytes: list[int | None]) -> float:
        """Hand the workers the parts' tables of contents; they receive the bytes over the transport."""
        ...


def deliver_to_workers(bucket: Any, next_bucket_bytes: list[int | None] | None, sink: BucketSink) -> float:
    """`deliver` for a transport whose stream carries contents (`TransportTraits.by_contents`): the workers receive."""
    return sink.receive_in_workers(list(bucket), list(next_bucket_bytes or ()))


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportTraits:
    """What the driver, the replicas and the workers decide by, once branches on a transport's name.

    The defaults are the common case: bytes by contents, no deltas, no group.
    """

    by_contents: bool = True
    """Whether only a bucket's table of contents crosses Ray and vLLM's RPC while the bytes go another way."""
    delta_base_in: str | None = None
    """Where a delta base is kept ("replica": the replica's process, "workers": each worker), or None: no deltas."""
    reads_ahead: bool = False
    """Whether the driver hands each bucket on with the next one's size, so that a worker posts its receive early
    (a broadcast must be met by a posted receive); each bucket then waits for the trainer's next one. Else each is
    handed on as soon as it exists."""
    one_group: bool = False
    """Whether every member is in one group: a member lost breaks every member's transfers, and one transfer
    reaches every replica (so all get the same kind of bucket)."""
    needs_core_in_process: bool = False
    """Whether the workers are reached through the engine core's RPC arguments, so the core must run in the
    replica's process (not AsyncLLM's, not a multiprocessing core)."""
    reaches_server: bool = False
    """Whether a `vllm serve` replica can take it (its bytes must not cross HTTP)."""
    opens_ipc_handles: bool = False
    """Whether a worker may open CUDA IPC handles a bucket's contents carry (another process's GPU memory: only where
    expected)."""
    maps_shared_memory: bool = False
    """Whether a worker may map the trainer's memory file a bucket's contents name (only where expected)."""
    one_host: bool = False
    """Whether every member must share one host (`refit.transport.shm.host_identity`): `transport="auto"` asks."""
    sender_methods: tuple[str, ...] = ()
    """What each trainer rank must have, beyond `refit.WeightSource`."""
    replica_methods: tuple[str, ...] = ()
    """What each replica must have, beyond `refit.RolloutReplica`."""


class TransportKind(Protocol):
    """One way a bucket's bytes travel from the trainer's ranks into the rollouts' workers."""

    name: str
    """The `SyncConfig.transport` string that selects it."""
    traits: TransportTraits
    """What the rest of refit decides by, as data."""

    # -- driver half ------------------------------------------------------------------
    def stream_handle(self, max_buckets_in_flight: int, form_group: Callable[[], Rendezvous]) -> StreamHandle:
        """What the trainer's stream is told to send over; `form_group` connects the members (collective only)."""
        ...

    def handles(self, handle: Any) -> bool:
        """Whether `handle` (a trainer's `transport` argument) names this transport."""
        ...

    # -- sender half ------------------------------------------------------------------
    def bucket_buffers(self, handle: Any) -> Callable[[int], np.ndarray] | None:
        """Where the trainer's producer writes each bucket (`refit.transport.buckets.buffers_from`): memory the
        transport sends from, or None: fresh host memory."""
        ...

    def send(self, buckets: Iterable[WireBucket], handle: Any,
             group: CollectiveGroup | None) -> Iterable[WireBucket] | Iterator[BucketContents]:
        """The buckets as the trainer's stream carries them; `group`: the trainer's collective group, if any."""
        ...

    # -- receiver half ----------------------------------------------------------------
    def deliver(self, bucket: Any, next_bucket_bytes: list[int | None] | None, sink: BucketSink, timeout_s: float) -> float:
        """A replica's `load_bucket`: load `bucket` (refs, or contents) through `sink`; seconds spent loading."""
        ...

    def prepare_worker(self) -> None:
        """Refuse, in a vLLM worker about to expect this transport's buckets, what cannot receive them."""
        ...

    def receive(self, parts: list[BucketContents], receivers: list[BucketReceiver], next_bucket_bytes: Sequence[int | None],
                device: torch.device) -> list[WireBucket]:
        """In a worker, the bucket whose `parts` (one per sending rank) the update names, received."""
        ...

    def loaded(self, parts: list[BucketContents]) -> None:
        """In a worker, after the received bucket's tensors were loaded: refuse it if its bytes changed meanwhile."""
        ...
