"""What `Syncer` needs from each side, as types.

Both protocols describe the methods of an *actor*: `Syncer` calls them as
`handle.method.remote(...)` on Ray actor handles, or directly on plain
objects that implement them (a single-process setup, or the fast test tier).
They are structural (PEP 544): implement the methods, no import or
subclassing needed, as with vLLM's `VLLMWeightSyncClient`.
`actors.TrainerActor` and `actors.RolloutActor` are the ready-made ones; an
actor with its own engine delegates them to `refit.llm_replica(llm)` or
`refit.async_llm_replica(llm)` (`refit.ReplicaMethods` and
`refit.AsyncReplicaMethods` do; examples/own_engine.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from refit.engine.lifecycle import FinishedUpdate, ReplicaStatus
    from refit.plan.config import SyncConfig
    from refit.plan.tensors import TensorMeta
    from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
    from refit.transport.buckets import BucketContents, WireBucket
    from refit.verification.probe import ProbeRequest

__all__ = ["RolloutReplica", "ShardedWeightSource", "WeightSource", "accepts", "has_method", "missing_methods"]


@runtime_checkable
class WeightSource(Protocol):
    """A trainer: where a sync reads the policy's current weights.

    Call order per sync: `weight_metadata` (once per `Syncer`, to plan), then
    `stream_buckets(plan)` once per sync. A source must not import vLLM.
    """

    def weight_metadata(self) -> list[TensorMeta]:
        """Every tensor's name, shape, dtype and module classes in checkpoint format, no data.

        `refit.describe_weights(model)` gives it for a torch model (fused MoE
        experts as the per-expert tensors a checkpoint holds). A rank of a
        sharded trainer may report only the names it holds.
        """
        ...

    def stream_buckets(self, plan: TransferPlan) -> Iterator[WireBucket | BucketContents]:
        """A generator of the plan's buckets in plan order (`refit.produce_buckets(plan, refit.checkpoint_tensors(model))`).

        Called with Ray's `num_returns="streaming"`: the trainer runs at most
        `max_buckets_in_flight` buckets ahead. The stream is closed (the
        generator's `finally` runs) when a sync ends early. Checks every tensor
        before the first bucket, so bad state sends nothing.

        Other transports than `"ray"` call `stream_buckets(plan, transport)`
        (the collective group's `Rendezvous`, or `"ipc"`): pass the buckets
        through a `refit.transport.sender.TransportSender`'s `send`, which
        yields each bucket's contents while the bytes take the other road.
        `"collective"` also needs `join_transport(rendezvous, rank)`,
        `leave_transport()` and `transport_group()` (the sender's `join`,
        `leave`, `group_id`); `actors.TrainerActor` has all of them.

        Delta syncs (optional): a source that has `base_entries()` (the
        sender's, `TransportSender.base_entries`) and whose `stream_buckets`
        takes a third argument named `delta` is called
        `stream_buckets(plan, transport, delta)` and passes its buckets
        through `TransportSender.encode(buckets, delta)` first. Any other
        source gets full syncs.
        """
        ...


class ShardedWeightSource(Protocol):
    """A trainer whose weights are spread over ranks (FSDP2, Megatron): a weight source per rank.

    Each rank reports the tensors it holds (`weight_metadata`, global shapes;
    a rank may hold only part of the names, as with pipeline or expert
    parallelism) and streams, for every bucket of the plan, its part of it:
    possibly empty, with row slices marked (`refit.sharding.RankSource` does
    both for row-sharded DTensors). All ranks stream at the same time, so
    they may meet in collectives.
    """

    ranks: Sequence[WeightSource]


@runtime_checkable
class RolloutReplica(Protocol):
    """A rollout engine refit updates in place; its update lifecycle, in call order.

    `begin_update` -> `load_bucket` per bucket -> `finish_update`, or
    `abort_update` from any point. Every exit leaves the replica either
    serving a whole, named version or refusing to serve with a reason.

    Optional: `base_digest(transport)`, the digest of the version it serves
    if it keeps that version's bytes to rebuild deltas (`refit.ReplicaCore`
    does); a replica without it gets full syncs.
    """

    def describe(self) -> RolloutModelInfo:
        """The rollout model's quantization config and embedding tying. Never blocks on an update."""
        ...

    def status(self) -> ReplicaStatus:
        """Phase (serving, updating, refusing), served version, refusal reason. Never blocks."""
        ...

    def node_id(self) -> str:
        """The Ray node the replica runs on."""
        ...

    def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        """Pause serving (after in-flight requests), start a reload; returns the lowest version it accepts.

        Refuses (naming the other sync) while another sync's update is open
        and alive; an update that got no call for `config.timeout_s` is closed
        by the replica itself.
        """
        ...

    def load_bucket(
        self, sync_id: str, version: int, bucket: WireBucket | list, next_bucket_bytes: list[int | None] | None = None
    ) -> float:
        """Load one bucket of update `version`; returns seconds spent loading.

        Through Ray the bucket arrives as a one-element list holding its object
        ref, which the replica fetches itself (see `refit.orchestration.calls.BucketStream`).
        Over `"collective"` or `"ipc"` it is a `BucketContents`, followed by
        the next bucket's size (`next_bucket_bytes`), and the replica's
        workers receive the bytes; such replicas also have `join_transport`,
        `leave_transport`, `transport_group` and `transport_ranks`
        (`actors.RolloutActor`, `actors.AsyncRolloutActor`).
        """
        ...

    def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        """Check completeness, finalize, run the post-refit stage (and the probe, with `verify="probe"`), serve `version`.

        On failure the replica refuses to serve.
        """
        ...

    def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        """Close `sync_id`'s update, if open; returns the status it leaves."""
        ...


def missing_methods(obj: object, protocol: type) -> list[str]:
    """Methods of `protocol` that `obj` (a plain object or a Ray actor handle) lacks."""
    names = [n for n in protocol.__dict__ if not n.startswith("_") and callable(getattr(protocol, n))]
    return [n for n in names if not has_method(obj, n)]


def accepts(obj: object, method: str, parameter: str) -> bool:
    """Whether `obj`'s `method` (of a plain object or a Ray actor handle) takes an argument named `parameter`.

    Why: an optional argument of a protocol method (`stream_buckets`'s
    `delta`) must not reach a source whose override does not take it, e.g. a
    subclass of `TrainerActor` that streams its own buckets.
    """
    bound = getattr(obj, method)
    parameters = getattr(bound, "_signature", None)  # a Ray actor method's, as inspect.Parameter objects
    if parameters is None:
        parameters = inspect.signature(bound).parameters.values()
    return any(p.name == parameter for p in parameters)


def has_method(obj: object, name: str) -> bool:
    """Whether `obj` (a plain object or a Ray actor handle) has a method `name`."""
    # A Ray actor handle raises AttributeError for a method its class lacks.
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True


