"""The collective transport: buckets broadcast from the trainer straight into vLLM's workers.

Why: through Ray's object store every byte is copied into host memory, read
by the rollout actor, and handed to the workers as RPC arguments, which also
pins vLLM's engine core inside the rollout actor's process. Here the sending
trainer rank and every worker of every replica form one group; a bucket is
one broadcast, and only its table of contents (`BucketContents`) crosses
Ray and vLLM's RPC. So it works with the engine core in its own process and
with tensor-parallel workers, like vLLM's own NCCL weight-transfer backend.

The group is stateless: its own TCPStore rendezvous (hosted by the driver
for the group's life) and a prefix of its own, never torch's default group,
which the trainer's FSDP or vLLM's tensor parallelism may own. gloo on the
CPU, NCCL on CUDA, chosen in one place (`backend_for_this_machine`), with
one code path. Every wait has the group's deadline; a member that never
joins fails the others with its name, not a hang.

Order of one bucket, and why it overlaps: the sender yields bucket i's
contents, then broadcasts it asynchronously and packs bucket i+1 meanwhile.
A worker loading bucket i has already posted the receive of bucket i+1 into
its other buffer (the driver passes i+1's size along), so bucket i+1 is in
flight while bucket i loads.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from refit.errors import SyncTimeoutError, TransportError
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.devices import backend_for_this_machine

__all__ = ["BucketReceiver", "BucketSender", "CollectiveGroup", "Rendezvous", "RendezvousHost"]

log = logging.getLogger("refit.transport")

_SENDER = 0  # the trainer's rank in every group; workers follow


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and how a collective group meets; plain data, sent to every member.

    `members` names each rank (rank = position), so an error can say who is
    missing: rank 0 is the sending trainer, then each replica's workers.
    """

    host: str
    port: int
    group_id: str
    members: tuple[str, ...]
    timeout_s: float

    @property
    def world_size(self) -> int:
        return len(self.members)


class RendezvousHost:
    """The TCPStore a group meets at, held by the driver for the group's life."""

    def __init__(self, members: Iterable[str], timeout_s: float) -> None:
        host = _this_host()
        self._store = torch.distributed.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.rendezvous = Rendezvous(host, self._store.port, uuid.uuid4().hex[:12], tuple(members), float(timeout_s))

    def close(self) -> None:
        self._store = None


class CollectiveGroup:
    """One member's handle on a broadcast group (see the module docstring)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, backend: torch.distributed.ProcessGroup, store) -> None:
        self.rendezvous = rendezvous
        self.rank = rank
        self.device = torch.device(backend_for_this_machine()[1], torch.cuda.current_device() if torch.cuda.is_available() else None)
        self._backend = backend
        self._store = store  # the client connection must outlive the backend's set-up

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int) -> CollectiveGroup:
        """Join as `rank`; blocks until every member has joined, or raises naming who did not."""
        if not 0 <= rank < rendezvous.world_size:
            raise TransportError(f"rank {rank} is outside group {rendezvous.group_id} of {rendezvous.world_size} members")
        deadline = time.monotonic() + rendezvous.timeout_s
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        _reach(rendezvous, deadline)
        store = torch.distributed.TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=timeout)
        members = torch.distributed.PrefixStore(f"refit/{rendezvous.group_id}/", store)
        members.set(f"joined/{rank}", rendezvous.members[rank])
        _wait_for_members(members, rendezvous, deadline)
        backend_name, _ = backend_for_this_machine()
        if backend_name == "nccl":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = torch.distributed.ProcessGroupNCCL(members, rank, rendezvous.world_size, options)
        else:
            backend = torch.distributed.ProcessGroupGloo(members, rank, rendezvous.world_size, timeout)
        log.debug("%s joined group %s as rank %d of %d", rendezvous.members[rank], rendezvous.group_id, rank, rendezvous.world_size)
        return cls(rendezvous, rank, backend, store)

    def broadcast(self, tensor: torch.Tensor) -> torch.distributed.Work:
        """Start broadcasting `tensor` from the sender into every member's `tensor`; returns the pending work."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = _SENDER
        options.timeout = datetime.timedelta(seconds=self.rendezvous.timeout_s)
        return self._backend.broadcast([tensor], options)

    def wait(self, work: torch.distributed.Work, what: str) -> None:
        """Wait for a broadcast within the group's deadline; raise naming the group and `what`."""
        try:
            work.wait(datetime.timedelta(seconds=self.rendezvous.timeout_s))
        except RuntimeError as error:
            raise TransportError(
                f"{what} over collective group {self.rendezvous.group_id} failed for "
                f"{self.rendezvous.members[self.rank]}: {str(error).splitlines()[0]}; a member died, left, "
                f"or stopped within {self.rendezvous.timeout_s:.0f} s (SyncConfig.timeout_s)"
            ) from None

    def close(self) -> None:
        """Leave the group; pending broadcasts fail on the other members within their deadline."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.shutdown()
            except RuntimeError:  # already broken by a failed member: nothing left to release
                pass
        self._store = None


class BucketSender:
    """The trainer's end: yields each bucket's contents, broadcasts its bytes (see the module docstring)."""

    def __init__(self, group: CollectiveGroup) -> None:
        if group.rank != _SENDER:
            raise TransportError(f"only rank {_SENDER} of a collective group sends; this member is rank {group.rank}")
        self.group = group

    def send(self, buckets: Iterable[WireBucket]) -> Iterator[BucketContents]:
        pending: tuple[torch.distributed.Work, torch.Tensor, int] | None = None
        try:
            for bucket in buckets:  # packing this bucket overlapped the previous broadcast
                yield bucket.contents()
                if pending is not None:
                    self.group.wait(pending[0], f"sending bucket {pending[2]}")
                data = _as_uint8(bucket.buffer).to(self.group.device)
                pending = (self.group.broadcast(data), data, bucket.index)
            if pending is not None:
                self.group.wait(pending[0], f"sending bucket {pending[2]}")
        finally:
            pending = None


class BucketReceiver:
    """A worker's end: two preallocated buffers; bucket i+1 arrives in one while bucket i loads from the other."""

    def __init__(self, group: CollectiveGroup) -> None:
        self.group = group
        self._buffers: list[torch.Tensor] = []
        self._pending: dict[int, tuple[torch.distributed.Work, torch.Tensor]] = {}

    def prepare(self, max_bucket_bytes: int) -> None:
        """Hold two buffers of at least `max_bucket_bytes` (kept across syncs while large enough)."""
        self._pending.clear()
        if not self._buffers or self._buffers[0].numel() < max_bucket_bytes:
            self._buffers = [torch.empty(max_bucket_bytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]

    def receive(self, contents: BucketContents, next_bucket_bytes: int | None) -> WireBucket:
        """Bucket `contents.index`, whole; posts the receive of the next bucket first, so it lands while this one loads.

        The returned bucket's bytes live in a reused buffer until the bucket
        after next: copy whatever must outlive that.
        """
        index = contents.index
        if index not in self._pending:
            self._post(index, contents.nbytes)
        work, view = self._pending.pop(index)
        if next_bucket_bytes is not None and index + 1 not in self._pending:
            self._post(index + 1, next_bucket_bytes)
        self.group.wait(work, f"receiving bucket {index}")
        if view.numel() != contents.nbytes:
            raise TransportError(f"bucket {index} was posted for {view.numel()} bytes but its contents say {contents.nbytes}")
        return contents.with_bytes(view)

    def _post(self, index: int, nbytes: int) -> None:
        if not self._buffers or nbytes > self._buffers[0].numel():
            raise TransportError(
                f"bucket {index} has {nbytes} bytes, more than the {self._buffers[0].numel() if self._buffers else 0} "
                "prepared for this sync's plan; the trainer packs differently from its plan"
            )
        view = self._buffers[index % 2][:nbytes]
        self._pending[index] = (self.group.broadcast(view), view)


def _as_uint8(buffer) -> torch.Tensor:
    return buffer.view(torch.uint8) if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)


def _this_host() -> str:
    """This node's address as the other nodes see it (Ray's view when Ray runs here)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def _reach(rendezvous: Rendezvous, deadline: float) -> None:
    """Connect once by hand first: torch's store client retries silently and then raises a C++ trace."""
    while True:
        try:
            socket.create_connection((rendezvous.host, rendezvous.port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"cannot reach the rendezvous of collective group {rendezvous.group_id} at "
                    f"{rendezvous.host}:{rendezvous.port} within {rendezvous.timeout_s:.0f} s ({error}); the driver that hosts it "
                    "is gone, or a firewall or network separates this node from it"
                ) from None
            time.sleep(0.2)


def _wait_for_members(store, rendezvous: Rendezvous, deadline: float) -> None:
    keys = [f"joined/{rank}" for rank in range(rendezvous.world_size)]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [name for rank, name in enumerate(rendezvous.members) if not store.check([f"joined/{rank}"])]
            raise SyncTimeoutError(
                f"collective group {rendezvous.group_id}: {', '.join(missing)} did not join within "
                f"{rendezvous.timeout_s:.0f} s (SyncConfig.timeout_s); it is dead, hung, "
                f"or cannot reach {rendezvous.host}:{rendezvous.port}"
            )
        time.sleep(0.05)
