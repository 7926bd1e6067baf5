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

Each side's methods are declared here once, each marked `@required` or
`@optional` (refit checks for an optional one with `has_method` before it
calls it) and, for a replica, with the Ray concurrency group a threaded
actor runs it in. The protocols type checkers see (`WeightSource`,
`RolloutReplica`) hold the required methods; `FullWeightSource` and
`FullRolloutReplica` add the optional ones. `SOURCE_METHODS` and
`REPLICA_METHODS` are the resulting tables, name -> `MethodSpec`: the
delegating layers (`refit.ReplicaMethods`, `refit.AsyncReplicaMethods`,
actors/_replica_shell.py) are built from `REPLICA_METHODS`, and
tests/test_replica_contract.py checks every replica and source against them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from refit.adapters import AdapterMeta, AdapterWeights
    from refit.engine.lifecycle import FinishedUpdate, ReplicaStatus
    from refit.plan.config import SyncConfig
    from refit.plan.tensors import TensorMeta
    from refit.plan.transfer_plan import RolloutModelInfo, TransferPlan
    from refit.provenance import ScaleRecord
    from refit.transport.buckets import BucketContents, WireBucket
    from refit.transport.collective import Rendezvous
    from refit.verification.probe import ProbeRequest

__all__ = [
    "REPLICA_METHODS",
    "SOURCE_METHODS",
    "ConcurrencyGroup",
    "FullRolloutReplica",
    "FullWeightSource",
    "MethodSpec",
    "RolloutReplica",
    "ShardedWeightSource",
    "WeightSource",
    "accepts",
    "as_declared",
    "declared_methods",
    "has_method",
    "missing_methods",
]

ConcurrencyGroup = Literal["observe", "update", "serve"]
"""Where a threaded replica actor runs a method: "observe" answers without waiting for an update or a request,
"update" runs the update steps one at a time in submission order, "serve" waits out an update as a request would."""

_F = TypeVar("_F", bound=Callable[..., object])


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """How refit calls one declared method of a protocol."""

    optional: bool  # refit asks `has_method` first; without it the feature it serves is off
    group: ConcurrencyGroup | None = None  # a replica's: the Ray concurrency group it runs in; None for a source's


def required(group: ConcurrencyGroup | None = None) -> Callable[[_F], _F]:
    """Mark a protocol method every implementation has (`Syncer` refuses one that lacks it)."""
    return _marked(MethodSpec(optional=False, group=group))


def optional(group: ConcurrencyGroup | None = None) -> Callable[[_F], _F]:
    """Mark a protocol method an implementation may lack (refit checks with `has_method` before calling it)."""
    return _marked(MethodSpec(optional=True, group=group))


def _marked(spec: MethodSpec) -> Callable[[_F], _F]:
    def mark(method: _F) -> _F:
        method.__refit_method__ = spec  # type: ignore[attr-defined]
        return method

    return mark


def declared_methods(protocol: type) -> dict[str, MethodSpec]:
    """The methods `protocol` and its bases declare (`@required` or `@optional`), in declaration order, bases first."""
    return {name: spec for cls in reversed(protocol.__mro__) for name, value in vars(cls).items()
            if (spec := getattr(value, "__refit_method__", None)) is not None}


@runtime_checkable
class WeightSource(Protocol):
    """A trainer: where a sync reads the policy's current weights.

    Call order per sync: `weight_metadata` (once per `Syncer`, to plan), then
    `stream_buckets(plan)` once per sync. A source must not import vLLM.

    Not vLLM's `WeightSource` (vllm/distributed/weight_transfer/base.py), an
    ABC a trainer engine iterates for whole (name, tensor) pairs: this one is
    a structural protocol of an actor's methods, and what it streams are
    buckets of the plan, already quantized and tagged, as each rank holds
    them. The name is kept because it is what the object is to refit's users;
    the two never meet (a source must not import vLLM).
    """

    @required()
    def weight_metadata(self) -> list[TensorMeta]:
        """Every tensor's name, shape, dtype and module classes in checkpoint format, no data.

        `refit.describe_weights(model)` gives it for a torch model (fused MoE
        experts as the per-expert tensors a checkpoint holds). A rank of a
        sharded trainer may report only the names it holds.
        """
        ...

    @required()
    def stream_buckets(self, plan: TransferPlan) -> Iterator[WireBucket | BucketContents]:
        """A generator of the plan's buckets in plan order (`refit.produce_buckets(plan, refit.checkpoint_tensors(model))`).

        Called with Ray's `num_returns="streaming"`: the trainer runs at most
        `max_buckets_in_flight` buckets ahead. The stream is closed (the
        generator's `finally` runs) when a sync ends early. Checks every tensor
        before the first bucket, so bad state sends nothing. Yield each bucket
        (`for bucket in buckets: yield bucket`), or `yield from` a generator:
        Ray drives the method with `send()`, which a list's iterator lacks.

        Other transports than `"ray"` call `stream_buckets(plan, transport)`
        (the collective group's `Rendezvous`, or `"ipc"`): pass the buckets
        through a `refit.transport.sender.TransportSender`'s `send`, which
        yields each bucket's contents while the bytes take the other road.
        `"collective"` also needs `join_transport(rendezvous, rank)`,
        `leave_transport()` and `transport_group()` (the sender's `join`,
        `leave`, `group_id`; `FullWeightSource`); `actors.TrainerActor` has all of them.

        Delta syncs (optional): a source that has `base_entries()` (the
        sender's, `TransportSender.base_entries`) and whose `stream_buckets`
        takes a third argument named `delta` is called
        `stream_buckets(plan, transport, delta)` and passes its buckets
        through `TransportSender.encode(buckets, delta)` first. Any other
        source gets full syncs.
        """
        ...


class FullWeightSource(WeightSource, Protocol):
    """A `WeightSource` with the optional methods too, each for the feature that needs it (`actors.TrainerActor`)."""

    @optional()
    def base_entries(self) -> list[tuple]:
        """What the last stream sent (`TransportSender.base_entries`), for delta syncs; without it every sync is full."""
        ...

    @optional()
    def join_transport(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join a sync's collective group as sending member `rank` (`TransportSender.join`); `transport="collective"` needs it."""
        ...

    @optional()
    def leave_transport(self, group_id: str | None = None) -> None:
        """Leave collective group `group_id` if in it, or with None whichever group it is in (`TransportSender.leave`).

        The driver names the group it formed: a failed sync's clean-up must not take this source out of a group that
        another Syncer formed since, whose sync may be streaming. A source without the parameter leaves any group."""
        ...

    @optional()
    def transport_group(self) -> str | None:
        """The collective group this source is in, if any (`TransportSender.group_id`)."""
        ...

    @optional()
    def transport_host(self) -> str:
        """Who can map this process's memory files (`refit.transport.shm.host_identity`); `transport="shm"` needs it,
        and `"auto"` picks `shm` where every member answers the same."""
        ...

    @optional()
    def reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per prompt, the logprob of each token after the first: the reference `verify="probe"` compares with."""
        ...

    @optional()
    def base_reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """`reference_logprobs` of the base alone, without the LoRA adapter it trains: the reference for a rollout
        that serves LoRA, which a weight sync sends the base alone (`TransferPlan.lora_served`)."""
        ...

    @optional()
    def adapter_meta(self) -> AdapterMeta:
        """The LoRA adapter it trains, described without its bytes (name, PEFT config, shapes, digest);
        `Syncer.sync_adapter` checks it against the rollout's base before anything is sent."""
        ...

    @optional()
    def adapter_weights(self) -> AdapterWeights:
        """The LoRA adapter it trains (`refit.adapters.AdapterWeights`), returned once into Ray's object store."""
        ...

    @optional()
    def last_stream_stats(self) -> dict[str, float]:
        """What the last stream cost: "seconds" spent checking, quantizing and packing (the sync report's trainer
        time) and, from a rank of a sharded trainer, "gathered_bytes" it received from all-gathers."""
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

    The optional methods (delta syncs, the collective transport, what
    `refit inspect` shows) are `FullRolloutReplica`'s.
    """

    @required("observe")
    def describe(self) -> RolloutModelInfo:
        """The rollout model's quantization config and embedding tying. Never blocks on an update."""
        ...

    @required("observe")
    def status(self) -> ReplicaStatus:
        """Phase (serving, updating, refusing), served version, refusal reason. Never blocks."""
        ...

    @required("observe")
    def node_id(self) -> str:
        """The Ray node the replica runs on."""
        ...

    @required("update")
    def begin_update(self, plan: TransferPlan, sync_id: str, config: SyncConfig) -> int:
        """Pause serving (after in-flight requests), start a reload; returns the lowest version it accepts.

        Refuses (naming the other sync) while another sync's update is open
        and alive; an update that got no call for `config.timeout_s` is closed
        by the replica itself.
        """
        ...

    @required("update")
    def load_bucket(
        self, sync_id: str, version: int, bucket: WireBucket | list, next_bucket_bytes: list[int | None] | None = None
    ) -> float:
        """Load one bucket of update `version`; returns seconds spent loading.

        Through Ray the bucket arrives as a one-element list holding its object
        ref, which the replica fetches itself (see `refit.orchestration.calls.BucketStream`).
        Over `"collective"`, `"shm"` or `"ipc"` it is a `BucketContents`, followed by
        the next bucket's size (`next_bucket_bytes`), and the replica's
        workers receive the bytes; such replicas also have `join_transport`,
        `leave_transport`, `transport_group` and `transport_ranks`
        (`actors.RolloutActor`, `actors.AsyncRolloutActor`).
        """
        ...

    @required("update")
    def finish_update(self, sync_id: str, version: int, probe: ProbeRequest | None = None) -> FinishedUpdate:
        """Check completeness, finalize, run the post-refit stage (and the probe, with `verify="probe"`), serve `version`.

        On failure the replica refuses to serve.
        """
        ...

    @required("update")
    def abort_update(self, sync_id: str, reason: str) -> ReplicaStatus:
        """Close `sync_id`'s update, if open; returns the status it leaves."""
        ...


class FullRolloutReplica(RolloutReplica, Protocol):
    """A `RolloutReplica` with the optional methods too (refit's own replicas: `refit.ReplicaCore` and the actors)."""

    @optional("observe")
    def base_digest(self, transport: str) -> str | None:
        """The digest of the version this replica serves, if it holds that version's bytes as a delta base for
        `transport` (a sync over it may then send only what changed); None, or no such method: the next sync is full."""
        ...

    @optional("observe")
    def transports(self) -> dict:
        """What `SyncConfig(transport="auto")` picks by: `{"accepts": [transport names], "device": "cpu" | "cuda" | ...,
        "host": str}`, the transports this replica's engine can take, where its workers run, and the host they run on
        (`refit.transport.shm.host_identity`; empty or absent: unknown, so no `shm`). Without this method a replica is
        taken to accept `ray`, and `collective` if it has the group methods."""
        ...

    @optional("observe")
    def transport_ranks(self) -> int:
        """How many ranks this replica takes in a collective group: one per vLLM worker."""
        ...

    @optional("observe")
    def transport_group(self) -> str | None:
        """The collective group this replica's workers are in, if any."""
        ...

    @optional("observe")
    def last_update(self) -> dict | None:
        """The last update's outcome as plain data: sync id, version, buckets, seconds, scales written, digest."""
        ...

    @optional("update")
    def join_transport(self, rendezvous: Rendezvous, member_offset: int, sync_id: str | None = None) -> None:
        """Every worker joins a sync's collective group as members from `member_offset` on (leaving any earlier group).

        During an update only the sync that owns it (`sync_id`) may move the workers to another group.
        """
        ...

    @optional("update")
    def leave_transport(self, group_id: str | None = None) -> None:
        """Every worker leaves collective group `group_id` if in it, or with None whichever group it is in.

        The driver names the group it formed: a failed sync's clean-up must not take the workers out of a group that
        another Syncer formed since, whose sync may be streaming. A replica without the parameter leaves any group."""
        ...

    @optional("serve")
    def scale_records(self) -> list[ScaleRecord]:
        """Where every scale came from (also while refusing: that is when it matters most)."""
        ...

    @optional("update")
    def stage_adapter(self, sync_id: str, version: int, adapter: AdapterWeights, timeout_s: float) -> str:
        """Install a LoRA adapter from memory as `version`, beside the one served and serving no one yet; returns the
        digest of the bytes its workers built it from. Unloads the adapter the last swap retired first (its requests get up to
        `timeout_s`). A failure leaves the served adapter serving (`refit.Syncer.sync_adapter`, docs/lora.md)."""
        ...

    @optional("update")
    def serve_adapter(self, sync_id: str, version: int) -> dict:
        """New requests run on the staged `version` from now on; running ones finish on the adapter it replaces."""
        ...

    @optional("update")
    def unstage_adapter(self, sync_id: str, version: int) -> None:
        """Drop `sync_id`'s staged `version` (the adapter sync failed elsewhere in the fleet); the served one stays."""
        ...


SOURCE_METHODS: Final[Mapping[str, MethodSpec]] = MappingProxyType(declared_methods(FullWeightSource))
"""A weight source's methods, required and optional: the one list of them."""

REPLICA_METHODS: Final[Mapping[str, MethodSpec]] = MappingProxyType(declared_methods(FullRolloutReplica))
"""A rollout replica's methods, required and optional, each with its concurrency group: the one list of them."""


def as_declared(method: _F, cls: type, name: str, declared: Callable[..., object],
                signature_of: Callable[..., object] | None = None) -> _F:
    """`method`, made for `cls` by a delegating decorator, named and documented as the protocol declares `name`, with
    the signature of `signature_of` (default: the declaration), which Ray reads to check a call's arguments."""
    method.__name__, method.__qualname__ = name, f"{cls.__qualname__}.{name}"
    method.__module__, method.__doc__ = cls.__module__, declared.__doc__
    method.__signature__ = inspect.signature(signature_of or declared)  # type: ignore[attr-defined]
    return method


def missing_methods(obj: object, protocol: type) -> list[str]:
    """The required methods of `protocol` that `obj` (a plain object or a Ray actor handle) lacks."""
    return [name for name, spec in declared_methods(protocol).items() if not spec.optional and not has_method(obj, name)]


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


