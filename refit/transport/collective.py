"""The collective transport: buckets broadcast from the trainer straight into vLLM's workers.

Why: through Ray's object store every byte is copied into host memory, read
by the rollout actor, and handed to the workers as RPC arguments, which also
pins vLLM's engine core inside the rollout actor's process. Here the sending
trainer rank and every worker of every replica form a group; a bucket is
one broadcast, and only its table of contents (`BucketContents`) crosses
Ray and vLLM's RPC. So it works with the engine core in its own process and
with tensor-parallel workers, like vLLM's own NCCL weight-transfer backend.

A sharded trainer has several sending ranks, each with its part of every
bucket: each gets a channel of its own (itself and every worker), so the
parts travel side by side and no rank receives another's bytes.

The group is stateless: its own TCPStore rendezvous (hosted by the driver
for the group's life) and a prefix of its own, never torch's default group,
which the trainer's FSDP or vLLM's tensor parallelism may own.

Why the prefix is secret: a TCPStore has no authentication, and anyone who
reaches its port could otherwise join the group, read who is in it, or write
the `abandoned` key that makes every member give up. Every key of the group
lives under a prefix derived from the group's secret (`Rendezvous.secret`,
made by the driver and sent to members over Ray or a server's key-protected
HTTP, never written into the store); a store has no call that lists keys, so
a stranger without the secret finds none of them and can at worst keep the
store or the group's sockets busy until the sync's deadline. The bytes
themselves carry keyed integrity tags (refit/transport/integrity.py). gloo on the
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
import hashlib
import logging
import secrets
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from refit.errors import SyncTimeoutError, TransportError
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.devices import backend_for_this_machine

__all__ = ["JOIN_MARGIN_S", "BucketReceiver", "BucketSender", "CollectiveGroup", "Rendezvous", "RendezvousHost", "receive_parts"]

log = logging.getLogger("refit.transport")

_SENDER = 0  # the sending rank's rank in its channel; workers follow

JOIN_MARGIN_S = 10.0
"""How much longer than the group's deadline each relay of a member's join waits for its answer.

A member gives up on a missing one at the deadline and names it. Each relay
(a `vllm serve` replica's HTTP call to its workers, then the driver) waits
one margin more than the one it waits on, so the answer that says why, the
innermost, always arrives before the outer deadline.
"""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and how a collective group meets; plain data, sent to every member.

    `members` names each member (its index is its member number), so an
    error can say who is missing: the first `senders` are the sending
    trainer ranks, then each replica's workers. `secret`: what keys the
    group's entries in the store (see the module docstring); never shown.
    """

    host: str
    port: int
    group_id: str
    members: tuple[str, ...]
    timeout_s: float
    senders: int = 1
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def to_plain(self) -> list:
        """Plain data for vLLM's RPC (msgpack carries no refit classes)."""
        return [self.host, self.port, self.group_id, list(self.members), self.timeout_s, self.senders, self.secret]

    @classmethod
    def from_plain(cls, plain: list | tuple) -> Rendezvous:
        try:
            host, port, group_id, members, timeout_s, senders, secret = plain
            return cls(str(host), int(port), str(group_id), tuple(str(m) for m in members), float(timeout_s), int(senders),
                       str(secret))
        except (TypeError, ValueError) as error:
            raise TransportError(f"not a collective group's rendezvous ({error}); the sender is not refit's") from None


class RendezvousHost:
    """The TCPStore a group meets at, held by the driver for the group's life."""

    def __init__(self, members: Iterable[str], timeout_s: float, *, senders: int = 1) -> None:
        host = _this_host()
        self._store = torch.distributed.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.rendezvous = Rendezvous(host, self._store.port, uuid.uuid4().hex[:12], tuple(members), float(timeout_s), senders)

    def abandon(self, reason: str) -> None:
        """Tell members still waiting for the others to join that the group will not form, and why.

        Why: a member lost while the group forms (a replica's server that
        died) never joins, and the others would wait out the whole deadline
        in `join`, holding their update threads, before the survivors can
        begin again without it.
        """
        if self._store is not None:
            _group_store(self._store, self.rendezvous).set("abandoned", reason)

    def close(self) -> None:
        self._store = None


class CollectiveGroup:
    """One member's handle on one channel of a group: a sender and every worker (see the module docstring)."""

    def __init__(self, rendezvous: Rendezvous, member: int, backend: torch.distributed.ProcessGroup, store) -> None:
        self.rendezvous = rendezvous
        self.member = member
        self.rank = _channel_rank(rendezvous, member)
        self.device = torch.device(backend_for_this_machine()[1], torch.cuda.current_device() if torch.cuda.is_available() else None)
        self._backend = backend
        self._store = store  # the client connection must outlive the backend's set-up

    @classmethod
    def join(cls, rendezvous: Rendezvous, member: int) -> list[CollectiveGroup]:
        """Join as `member`: a sender its own channel, a worker every sender's channel, in channel order.

        Blocks until every member has joined, or raises naming who did not
        (or, once the driver abandoned the group, saying why).
        """
        if not 0 <= member < rendezvous.world_size:
            raise TransportError(f"member {member} is outside group {rendezvous.group_id} of {rendezvous.world_size} members")
        deadline = time.monotonic() + rendezvous.timeout_s
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        _reach(rendezvous, deadline)
        store = torch.distributed.TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=timeout)
        members = _group_store(store, rendezvous)
        members.set(f"joined/{member}", rendezvous.members[member])
        _wait_for_members(members, rendezvous, deadline)
        channels = [member] if member < rendezvous.senders else range(rendezvous.senders)
        size = 1 + rendezvous.world_size - rendezvous.senders
        rank = _channel_rank(rendezvous, member)
        groups = []
        for channel in channels:  # every worker joins them in the same order: no two wait on each other
            backend = _backend(torch.distributed.PrefixStore(f"{channel}/", members), rank, size, timeout)
            groups.append(cls(rendezvous, member, backend, store))
        log.debug("%s joined group %s (%d channel(s))", rendezvous.members[member], rendezvous.group_id, len(groups))
        return groups

    def broadcast(self, tensor: torch.Tensor) -> torch.distributed.Work:
        """Start broadcasting `tensor` from the channel's sender into every member's `tensor`; returns the pending work."""
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
                f"{self.rendezvous.members[self.member]}: {str(error).splitlines()[0]}; a member died, left, "
                f"or stopped within {self.rendezvous.timeout_s:.0f} s (SyncConfig.timeout_s)"
            ) from None

    def close(self) -> None:
        """Leave the channel; pending broadcasts fail on the other members within their deadline."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.shutdown()
            except RuntimeError:  # already broken by a failed member: nothing left to release
                pass
        self._store = None


class BucketSender:
    """A sending rank's end: yields each bucket's contents, broadcasts its bytes (see the module docstring)."""

    def __init__(self, group: CollectiveGroup) -> None:
        if group.rank != _SENDER:
            raise TransportError(f"only the sender of a channel sends; {group.rendezvous.members[group.member]} is a worker")
        self.group = group

    def send(self, buckets: Iterable[WireBucket]) -> Iterator[BucketContents]:
        pending: tuple[torch.distributed.Work, torch.Tensor, int] | None = None  # the tensor stays alive until sent
        for bucket in buckets:  # packing this bucket overlapped the previous broadcast
            yield bucket.contents()
            if pending is not None:
                self.group.wait(pending[0], f"sending bucket {pending[2]}")
                pending = None
            if bucket.nbytes:  # a rank may hold nothing of a bucket: then nobody posts a receive
                data = _as_uint8(bucket.buffer).to(self.group.device)
                pending = (self.group.broadcast(data), data, bucket.index)
        if pending is not None:
            self.group.wait(pending[0], f"sending bucket {pending[2]}")


class BucketReceiver:
    """A worker's end of one channel: two buffers, reused; bucket i+1 arrives in one while bucket i loads from the other.

    Each buffer is allocated at the first bucket it must hold and grows only
    for a larger one, so a worker holds two of its largest parts per channel
    across buckets and syncs.
    """

    def __init__(self, group: CollectiveGroup) -> None:
        self.group = group
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._pending: dict[int, tuple[torch.distributed.Work | None, torch.Tensor]] = {}

    def post(self, index: int, nbytes: int) -> None:
        """Start receiving bucket `index` (`nbytes` long) into its buffer, unless already posted."""
        if index in self._pending:
            return
        slot = index % 2
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:  # this slot's last bucket was loaded: free to replace
            buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        view = buffer[:nbytes]
        self._pending[index] = (self.group.broadcast(view) if nbytes else None, view)

    def take(self, contents: BucketContents) -> WireBucket:
        """Bucket `contents.index`, whole, once it has arrived (posted earlier, or now).

        Its bytes live in a reused buffer until the bucket after next: copy
        whatever must outlive that.
        """
        self.post(contents.index, contents.nbytes)
        work, view = self._pending.pop(contents.index)
        if work is not None:
            self.group.wait(work, f"receiving bucket {contents.index}")
        if view.numel() != contents.nbytes:
            raise TransportError(
                f"bucket {contents.index} was posted for {view.numel()} bytes but its contents say {contents.nbytes}; "
                "the driver and the trainer disagree on the stream"
            )
        return contents.with_bytes(view)

    def clear(self) -> None:
        """Forget receives of an update that ended (their broadcasts failed with it)."""
        self._pending.clear()


def receive_parts(
    receivers: list[BucketReceiver], contents: list[BucketContents], next_bytes: list[int | None]
) -> list[WireBucket]:
    """One bucket's part from every channel, each channel's next part posted first (so it lands while this one loads)."""
    if len(receivers) != len(contents) or len(contents) != len(next_bytes):
        raise TransportError(f"{len(contents)} part(s) announced for {len(receivers)} channel(s) of this worker's group")
    for receiver, part, upcoming in zip(receivers, contents, next_bytes):
        receiver.post(part.index, part.nbytes)
        if upcoming is not None:
            receiver.post(part.index + 1, upcoming)
    return [receiver.take(part) for receiver, part in zip(receivers, contents)]


def _channel_rank(rendezvous: Rendezvous, member: int) -> int:
    """A member's rank in its channels: the sender is 0, workers follow in member order."""
    return _SENDER if member < rendezvous.senders else 1 + member - rendezvous.senders


def _backend(store, rank: int, size: int, timeout: datetime.timedelta):
    if backend_for_this_machine()[0] == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, size, options)
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


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


def _group_store(store, rendezvous: Rendezvous):
    """The group's own keys in a rendezvous store, under a prefix only holders of its secret can name (a driver may
    host several groups over time)."""
    keyed = hashlib.blake2b(rendezvous.group_id.encode(), key=rendezvous.secret.encode(), digest_size=16).hexdigest()
    return torch.distributed.PrefixStore(f"refit/{keyed}/", store)


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
        if store.check(["abandoned"]):
            raise TransportError(f"collective group {rendezvous.group_id} will not form: {store.get('abandoned').decode()}")
        if time.monotonic() >= deadline:
            missing = [name for rank, name in enumerate(rendezvous.members) if not store.check([f"joined/{rank}"])]
            raise SyncTimeoutError(
                f"collective group {rendezvous.group_id}: {', '.join(missing)} did not join within "
                f"{rendezvous.timeout_s:.0f} s (SyncConfig.timeout_s); it is dead, hung, "
                f"or cannot reach {rendezvous.host}:{rendezvous.port}"
            )
        time.sleep(0.05)
